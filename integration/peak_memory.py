"""Peak memory of splitting MoE experts into nn.Linear layers, while loading against after it: one load (and
split) per fresh process, measured as layerswap.testing.load_probe measures a load.

    python integration/peak_memory.py CHECKPOINT MODEL_TYPE SPLIT WARMUP   # prints PEAK_MEMORY {json}

SPLIT is one of SPLITS: a stock load (no split), layerswap's '-quant' bundle, llm-compressor's `linearize_moe`
(after loading; what `oneshot` runs) and `load_quantizable_moe` (while loading), Defuser's `convert_model` (after
loading) and `replace_fused_blocks` (while loading). Each suite measures the splits of the tools it installs
(integration/llm_compressor, integration/defuser); docs/quantizers.md quotes their figures.

The child first loads and splits WARMUP, a tiny checkpoint of the same family, the same way (the first load of a
family imports its modeling code, a cost of the process), then resets its peak RSS (VmHWM through
/proc/self/clear_refs), loads and splits CHECKPOINT, reads every weight once (weights that need no copy stay views
of the mmapped checkpoint until read, as a first forward would read them), and reports above its RSS just before
loading: peak_mib (the peak while loading, splitting and reading), resident_mib (what stays), anon_mib (of that,
memory the process owns rather than pages of the mmapped checkpoint, which the kernel can drop), and the model's
expert and total weight sizes.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SPLITS = (
    "stock",
    "layerswap",
    "llm-compressor linearize_moe",
    "llm-compressor load_quantizable_moe",
    "Defuser convert_model",
    "Defuser replace_fused_blocks",
)
# Big enough that the experts (3 layers x 32 experts x 3 projections of 1024 x 256, fp32: 288 MiB) dominate what
# the load adds to the process; small enough to build in seconds.
LARGER = {
    "hidden_size": 1024,
    "intermediate_size": 256,  # mixtral's expert size; qwen2_moe's shared expert's is the next one
    "shared_expert_intermediate_size": 256,
    "moe_intermediate_size": 256,
    "num_experts": 32,
    "num_local_experts": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "head_dim": 128,
}


def save_larger_checkpoint(model_type: str, directory: Path) -> Path:
    """A random fp32 checkpoint of `model_type` with LARGER's sizes, saved as stock saves it."""
    from transformers import AutoConfig

    from tiny_checkpoints import save_tiny_checkpoint

    defaults = AutoConfig.for_model(model_type)
    return save_tiny_checkpoint(
        model_type, directory, **{key: size for key, size in LARGER.items() if hasattr(defaults, key)}
    )


def measure(checkpoint: Path, model_type: str, split: str, warmup: Path) -> dict:
    """One load + split of `checkpoint` in a fresh process, after the same of `warmup` (a tiny checkpoint of the
    family): peak_mib, resident_mib, anon_mib, expert_mib, weights_mib, expert_linears (how many expert
    projections are nn.Linear afterwards), wall_s."""
    command = [sys.executable, str(Path(__file__).resolve()), str(checkpoint), model_type, split, str(warmup)]
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PEAK_MEMORY ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{split} on {checkpoint} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("PEAK_MEMORY "))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _child(checkpoint: str, model_type: str, split: str, warmup: str) -> None:
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    if split == "layerswap":  # imported only where it is measured: nothing of it in the peers' processes
        import layerswap
    if split.startswith("llm-compressor"):
        from llmcompressor.modeling.moe.linearize import linearize_moe, load_quantizable_moe
    if split.startswith("Defuser"):
        import defuser

    def load(path: str) -> nn.Module:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def load_and_split(path: str) -> nn.Module:
        if split == "stock":
            return load(path)
        if split == "layerswap":
            with layerswap.use_bundle(f"{model_type}-quant"):
                return load(path)
        if split == "llm-compressor linearize_moe":
            return linearize_moe(load(path))
        if split == "llm-compressor load_quantizable_moe":
            with load_quantizable_moe():
                return load(path)
        if split == "Defuser convert_model":
            model = load(path)
            assert defuser.convert_model(model)
            return model
        if split == "Defuser replace_fused_blocks":
            return load(path)  # the classes were patched before the warm-up
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")

    if split == "Defuser replace_fused_blocks":
        assert defuser.replace_fused_blocks(model_type)
    # The same load and split of a tiny checkpoint of the family first: a process's first load of a family
    # imports its modeling module and all that imports (in transformers 5.24 with torchao installed, some 1,200
    # modules and 90 MiB, 4 s), a cost of the process, not of the split.
    load_and_split(warmup)
    gc.collect()

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: what came before is not the load's peak
    before, anon_before = _status_kib("VmRSS"), _status_kib("RssAnon")
    started = time.perf_counter()
    model = load_and_split(checkpoint)
    wall_s = time.perf_counter() - started
    with torch.no_grad():  # one element per 4 KiB page of every weight
        for parameter in model.parameters():
            flat = parameter.data.reshape(-1)
            flat[:: max(1, 4096 // flat.element_size())].sum()
    peak, resident, anon = _status_kib("VmHWM"), _status_kib("VmRSS"), _status_kib("RssAnon")
    experts = {
        id(p): p.numel() * p.element_size()
        for name, module in model.named_modules()
        if name.endswith(".experts")
        for p in module.parameters()
    }
    linears = [m for name, m in model.named_modules() if ".experts." in name and isinstance(m, nn.Linear)]
    result = {
        "peak_mib": (peak - before) / 1024,
        "resident_mib": (resident - before) / 1024,
        "anon_mib": (anon - anon_before) / 1024,
        "expert_mib": sum(experts.values()) / 2**20,
        "weights_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
        "expert_linears": len(linears),
        "wall_s": wall_s,
    }
    print("PEAK_MEMORY " + json.dumps(result))


SECTION = "peak memory of loading + splitting, above the RSS before loading (MiB)"


def record(measured: dict[str, list[str]], model_type: str, results: dict[str, dict]) -> None:
    """Add `results` (split -> measure's result, or {"error": its last line}) to the figures the suite prints at
    its end."""
    for split, r in results.items():
        if "error" in r:
            measured.setdefault(SECTION, []).append(f"{model_type}, {split}: fails: {r['error']}")
            continue
        measured.setdefault(SECTION, []).append(
            f"{model_type}, {split}: peak {r['peak_mib']:.0f}, after {r['resident_mib']:.0f} "
            f"({r['anon_mib']:.0f} owned); experts {r['expert_mib']:.0f} of {r['weights_mib']:.0f} of weights, "
            f"{r['expert_linears']} expert nn.Linear"
        )


if __name__ == "__main__":
    _child(*sys.argv[1:5])
