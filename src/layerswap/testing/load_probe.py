"""One `from_pretrained` in a fresh Python process, measured: wall time, peak RSS, resident and owned memory,
the model's footprint and the bytes of the distinct storages behind its weights.

Used by the load benchmark (benchmarks/load.py) and by the memory tests, and runnable alone:

    python -m layerswap.testing.load_probe DIRECTORY BUNDLE|- bf16|nf4|int8 cpu     # prints LOAD_RESULT {json}

The child resets its peak RSS after its imports (VmHWM via clear_refs: the `ru_maxrss` of getrusage survives
execve and would report the parent's peak), then reports, above its RSS just before `from_pretrained`:
load_peak_rss_mib (while loading and then reading every weight once: zero-copy weights are views of the mmapped
checkpoint and become resident only when read), resident_after_mib, anon_after_mib (memory the process owns, not
checkpoint pages), wall_s, footprint_mib and held_storage_mib.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SCHEMES = ("bf16", "nf4", "int8")
LAYOUTS = ("per-expert", "fused")


@dataclass(frozen=True)
class CheckpointShape:
    """A qwen2_moe small enough to make in seconds, big enough that its experts dominate the process's memory."""

    hidden: int = 1024
    moe_intermediate: int = 512
    experts: int = 32
    layers: int = 3
    vocab: int = 1024

    @property
    def label(self) -> str:
        return f"qwen2_moe h{self.hidden} i{self.moe_intermediate} e{self.experts} l{self.layers}"


def make_checkpoint(shape: CheckpointShape, directory: Path, layout: str = "per-expert") -> int:
    """Save a random bf16 qwen2_moe checkpoint of `shape` to `directory`; returns its size in bytes.

    "per-expert": as stock `save_pretrained` writes it (`experts.{i}.gate_proj.weight`, like the published
    checkpoints); "fused": the stock in-memory layout (`experts.gate_up_proj` [E, 2I, H]), as some tools save."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2_moe",
        hidden_size=shape.hidden,
        intermediate_size=2 * shape.moe_intermediate,
        moe_intermediate_size=shape.moe_intermediate,
        shared_expert_intermediate_size=shape.moe_intermediate,
        num_experts=shape.experts,
        num_experts_per_tok=4,
        num_hidden_layers=shape.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=shape.vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if layout == "fused":
        model.config.save_pretrained(directory)
        tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    elif layout == "per-expert":
        model.save_pretrained(directory)
    else:
        raise ValueError(f"layout must be 'per-expert' or 'fused', got {layout!r}")
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss_kib() -> int:
    """Reset this process's peak RSS to its current RSS (Linux >= 4.0) and return that, in KiB.

    Neither `getrusage(RUSAGE_SELF)` nor `RUSAGE_CHILDREN` will do: `ru_maxrss` survives `execve`, so a child
    starts with its parent's peak (here, the parent that just built the checkpoint). VmHWM belongs to the new
    address space; clearing it also drops the transient peak of the imports."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not permitted: the imports' peak stays in the baseline
        return _proc_status_kib("VmHWM")
    return _proc_status_kib("VmRSS")


def _child(directory: str, bundle: str, scheme: str, device: str) -> None:
    """One load, in this fresh process; prints one JSON line."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    import layerswap

    quantization = {
        "nf4": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
        "int8": {"load_in_8bit": True},
    }
    kwargs = {"dtype": torch.bfloat16, "device_map": {"": device}}
    if scheme in quantization:
        kwargs["quantization_config"] = BitsAndBytesConfig(**quantization[scheme])
    before_kib, anon_before_kib = _reset_peak_rss_kib(), _proc_status_kib("RssAnon")
    bundles = [bundle] if bundle else []
    started = time.perf_counter()
    with layerswap.use_bundle(*bundles):
        model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    wall_s = time.perf_counter() - started
    # Bytes of the distinct storages behind the weights: what the model holds, whatever the allocator keeps.
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in (*model.parameters(), *model.buffers())
    }
    # Weights that need no conversion stay views of the mmapped checkpoint, resident only once read: read one
    # element per 4 KiB page of each, as a first forward pass would, so both loads count what they hold.
    with torch.no_grad():
        for parameter in model.parameters():
            flat = parameter.data.reshape(-1)
            flat[:: max(1, 4096 // flat.element_size())].float().sum()
    peak_kib, resident_kib, anon_kib = (_proc_status_kib(f) for f in ("VmHWM", "VmRSS", "RssAnon"))
    result = {
        "wall_s": wall_s,
        "peak_rss_mib": peak_kib / 1024,
        "load_peak_rss_mib": (peak_kib - before_kib) / 1024,
        "resident_after_mib": (resident_kib - before_kib) / 1024,
        # Of that, memory the process owns (not pages of the mmapped checkpoint, which the kernel can drop).
        "anon_after_mib": (anon_kib - anon_before_kib) / 1024,
        "footprint_mib": model.get_memory_footprint() / 2**20,
        "held_storage_mib": sum(storages.values()) / 2**20,
    }
    if device.startswith("cuda"):
        result["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print("LOAD_RESULT " + json.dumps(result))


def _child_command(directory: Path, bundle: str, scheme: str, device: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "layerswap.testing.load_probe",
        str(directory),
        bundle or "-",
        scheme,
        device,
    ]


def _child_env() -> dict[str, str]:
    # The child imports this very layerswap, installed or not.
    package_parent = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH", "")) if p)
    return dict(
        os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONPATH=path
    )


def _parse(stdout: str, stderr: str, returncode: int, what: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("LOAD_RESULT ")]
    if returncode != 0 or not lines:
        raise RuntimeError(f"load ({what}) failed with exit code {returncode}:\n{stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("LOAD_RESULT "))


def load_once(directory: Path, bundle: str, scheme: str, device: str = "cpu", timeout_s: float = 600) -> dict:
    """One from_pretrained in a fresh subprocess: wall_s, peak_rss_mib, load_peak_rss_mib, resident_after_mib,
    footprint_mib (and cuda_peak_mib on CUDA)."""
    done = subprocess.run(
        _child_command(directory, bundle, scheme, device),
        capture_output=True,
        text=True,
        env=_child_env(),
        timeout=timeout_s,
        check=False,
    )
    return _parse(
        done.stdout, done.stderr, done.returncode, f"{directory}, bundle {bundle or 'none'}, {scheme}"
    )


def load_concurrently(jobs: Sequence[tuple[Path, str, str]], timeout_s: float = 300) -> list[dict]:
    """Several (directory, bundle, scheme) loads on CPU, each in its own process, all at once: for memory
    figures only (each process's peak RSS is its own; wall times would be skewed by the others)."""
    processes = [
        subprocess.Popen(
            _child_command(d, b, s, "cpu"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_child_env(),
        )
        for d, b, s in jobs
    ]
    results = []
    for process, (d, b, s) in zip(processes, jobs, strict=True):
        stdout, stderr = process.communicate(timeout=timeout_s)
        results.append(_parse(stdout, stderr, process.returncode, f"{d}, bundle {b or 'none'}, {s}"))
    return results


if __name__ == "__main__":
    _child(sys.argv[1], "" if sys.argv[2] == "-" else sys.argv[2], sys.argv[3], sys.argv[4])
