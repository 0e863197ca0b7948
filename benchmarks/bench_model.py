"""Whole-model MoE benchmark: prefill and decode tokens/s and memory, stock vs layerswap bundles, in one run.

    python benchmarks/bench_model.py                  # Qwen1.5-MoE-A2.7B layer shapes, 2 layers (a few minutes)
    python benchmarks/bench_model.py --quick          # 1 layer, shorter prompt, fewer rounds
    python benchmarks/bench_model.py --tiny --quick   # the tiny test model: seconds (what the tests run)

The model: Qwen1.5-MoE-A2.7B's config from model_shapes.json (layerswap.shapes; never downloaded) with
`--layers` decoder layers and a `--vocab`-token vocabulary (the real 151936 would make the embedding and lm_head
the largest weights of a 2-layer model), random bf16 weights saved once with save_pretrained into a temp dir.
Each provider loads that checkpoint with `from_pretrained`:

    stock              stock transformers, bf16
    quant              qwen2_moe-quant (experts as nn.Linear), bf16
    quant+nf4          qwen2_moe-quant + bitsandbytes 4-bit nf4
    quant+int8         qwen2_moe-quant + bitsandbytes LLM.int8
    quant+torchao-int8 qwen2_moe-quant + torchao int8 weight-only (TorchAoConfig(Int8WeightOnlyConfig()))
    fast               qwen2_moe-fast (fused experts, dispatched per CPU; fused q/k/v), bf16

All models stay loaded and take turns, round by round in a shuffled order: a prefill of `--prompt` tokens, then
`--decode` greedy decode steps on its KV cache. Reported: prefill and decode tokens/s (median, p20, p80 over
rounds), and per round the ratio to stock's round (speedup_vs_stock, > 1 is faster), so that load from other
processes hits every provider alike. Memory, per provider: the weight footprint (`stored_bytes`: what
`get_memory_footprint` counts, torchao's tensor subclasses by their int8 data and scales), the peak RSS while
loading and while running one prefill + decode, each above the RSS just before (VmHWM reset through
/proc/self/clear_refs; "nan" where the kernel does not allow it), and their ratios to stock.
CSV columns: kernel, provider, shape, dtype, tokens, metric, median, p20, p80, device, then the machine
(benchmarks/machine.py).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import logging as pylogging
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import layerswap
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parent / "src"))
    import layerswap

from layerswap.shapes import resolve_config  # noqa: E402
from machine import MACHINE_FIELDS, RESULT_FIELDS, csv_path, machine_fields, machine_label  # noqa: E402

MODEL = "Qwen/Qwen1.5-MoE-A2.7B"
PROVIDERS = ("stock", "quant", "quant+nf4", "quant+int8", "quant+torchao-int8", "fast")
CSV_FIELDS = (*RESULT_FIELDS, *MACHINE_FIELDS)


@dataclass(frozen=True)
class Settings:
    layers: int = 2
    vocab: int = 32000
    prompt: int = 32
    decode: int = 8
    rounds: int = 3
    tiny: bool = False

    @classmethod
    def quick(cls, tiny: bool = False) -> Settings:
        return cls(layers=1, vocab=8192, prompt=16, decode=4, rounds=2, tiny=tiny)


def model_config(settings: Settings) -> Any:
    if settings.tiny:
        from layerswap.testing import tiny_config

        return tiny_config("qwen2_moe")
    config = resolve_config(MODEL)
    config.num_hidden_layers = settings.layers
    if getattr(config, "layer_types", None):  # one entry per layer, validated on save
        config.layer_types = config.layer_types[: settings.layers]
    config.vocab_size = settings.vocab
    config.tie_word_embeddings = False
    return config


def shape_label(config: Any, settings: Settings) -> str:
    if settings.tiny:
        return "tiny qwen2_moe"
    return f"{MODEL.split('/')[-1]} x{config.num_hidden_layers} layers, vocab {config.vocab_size}"


def make_checkpoint(config: Any, directory: Path) -> None:
    """Random bf16 weights, written with stock save_pretrained (the per-expert layout published checkpoints use).
    Built on the meta device and filled one tensor at a time: no fp32 copy of the whole model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")  # buffers (rotary) are not saved: from_pretrained recomputes them
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in model.parameters():
            if tensor.dim() == 1:
                tensor.fill_(1.0)  # norms
            else:
                # Scaled like a trained model's (activations stay O(1)), one slice at a time (no fp32 copy).
                std = tensor.shape[-1] ** -0.5
                for piece in tensor.view(-1, tensor.shape[-1]).split(4096):
                    piece.copy_(torch.randn(piece.shape, generator=generator) * std)
    model.save_pretrained(directory)


def _quantization(provider: str) -> Any:
    scheme = provider.partition("+")[2]
    if not scheme:
        return None
    if scheme in ("nf4", "int8"):
        from transformers import BitsAndBytesConfig

        if scheme == "nf4":
            return BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
            )
        return BitsAndBytesConfig(load_in_8bit=True)
    if scheme == "torchao-int8":
        from torchao.quantization import Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        return TorchAoConfig(Int8WeightOnlyConfig())
    raise ValueError(f"unknown quantization scheme {scheme!r} in provider {provider!r}")


def _bundle(provider: str) -> str | None:
    kind = provider.partition("+")[0]
    return None if kind == "stock" else f"qwen2_moe-{kind}"


# --- memory ---------------------------------------------------------------------------------------------------


def _status_kib(field: str) -> float:
    with contextlib.suppress(OSError), open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return float(line.split()[1])
    return float("nan")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


class PeakRss:
    """Peak RSS above the RSS at entry, in MiB (nan where VmHWM cannot be reset)."""

    def __enter__(self) -> PeakRss:
        gc.collect()
        self.ok = _reset_peak_rss()
        self.before = _status_kib("VmRSS")
        self.mib = float("nan")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.ok:
            self.mib = (_status_kib("VmHWM") - self.before) / 1024


# --- providers --------------------------------------------------------------------------------------------------


@dataclass
class Loaded:
    name: str
    model: Any
    footprint_mib: float
    load_peak_mib: float
    forward_peak_mib: float = float("nan")
    cache: Any = None


def load(provider: str, directory: Path) -> Loaded:
    from transformers import AutoModelForCausalLM

    bundle = _bundle(provider)
    kwargs: dict[str, Any] = {"dtype": torch.bfloat16}
    quantization = _quantization(provider)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    with PeakRss() as peak, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantizers' notes about CPU kernels and dtypes
        scope = layerswap.use_bundle(bundle) if bundle else contextlib.nullcontext()
        with scope:
            model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
        model.eval()
        for parameter in model.parameters():  # zero-copy weights are mmapped views: read every page once
            with contextlib.suppress(Exception):  # a quantized tensor subclass may not slice
                parameter.data.reshape(-1)[::1024].float().sum()
    return Loaded(provider, model, stored_bytes(model) / 2**20, peak.mib)


def _tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor stores: for a tensor subclass (torchao's quantized weights) its inner tensors, since
    `element_size()` reports the dtype it stands for (bf16), not its int8 data and scales."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.nelement() * tensor.element_size()


def stored_bytes(model: torch.nn.Module) -> int:
    """The weight footprint as `get_memory_footprint()` counts it (parameters and buffers), tensor subclasses
    by what they store."""
    return sum(_tensor_bytes(t) for t in (*model.parameters(), *model.buffers()))


def prefill(loaded: Loaded, prompt: torch.Tensor) -> torch.Tensor:
    out = loaded.model(input_ids=prompt, use_cache=True)
    loaded.cache = out.past_key_values
    return out.logits[:, -1:].argmax(-1)


def decode(loaded: Loaded, token: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        out = loaded.model(input_ids=token, past_key_values=loaded.cache, use_cache=True)
        loaded.cache = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
    return token


def _quantiles(values: Sequence[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=10, method="inclusive")
    return statistics.median(values), q[1], q[7]


def _progress(iterable, **kwargs):
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, file=sys.stderr, **kwargs)


def sweep(
    settings: Settings,
    providers: Sequence[str] = PROVIDERS,
    log: Callable[[str], None] = lambda text: print(text, file=sys.stderr),
) -> list[dict[str, object]]:
    """Builds the checkpoint, loads every provider, times them in turns; returns CSV rows."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    # bitsandbytes says on every int8 matmul that it casts bf16 inputs to fp16 (a warning in older releases, a
    # log record since).
    warnings.filterwarnings("ignore", message="MatMul8bitLt")
    pylogging.getLogger("bitsandbytes").setLevel(pylogging.ERROR)
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
    if "stock" not in providers:
        providers = ["stock", *providers]  # every ratio is to stock
    config = model_config(settings)
    label = shape_label(config, settings)
    device = f"cpu x{torch.get_num_threads()}"
    machine = machine_fields()
    rows: list[dict[str, object]] = []

    def add(provider: str, tokens: object, metric: str, stats: tuple[float, float, float]) -> None:
        median, p20, p80 = stats
        rows.append(
            {
                "kernel": "model",
                "provider": provider,
                "shape": label,
                "dtype": "bfloat16",
                "tokens": tokens,
                "metric": metric,
                "median": median,
                "p20": p20,
                "p80": p80,
                "device": device,
                **machine,
            }
        )

    with tempfile.TemporaryDirectory(prefix="layerswap-bench-model-") as tmp:
        directory = Path(tmp) / "checkpoint"
        started = time.perf_counter()
        make_checkpoint(config, directory)
        log(
            f"# checkpoint: {label}, {sum(f.stat().st_size for f in directory.iterdir()) / 2**30:.2f} GiB "
            f"in {time.perf_counter() - started:.0f} s"
        )
        loaded: dict[str, Loaded] = {}
        for provider in _progress(providers, desc="loading"):
            try:
                loaded[provider] = load(provider, directory)
            except Exception as error:  # a missing quantizer or a kernel this CPU lacks: the rest still runs
                if provider == "stock":
                    raise
                log(f"# skip {provider}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    # The checkpoint is gone: quantized or copied weights only (stock's stacked 3D experts are copies too).

    prompt = torch.randint(
        0, config.vocab_size, (1, settings.prompt), generator=torch.Generator().manual_seed(1)
    )
    with torch.inference_mode():
        for item in loaded.values():  # untimed: warm-up (first-call allocations, CPU calibration) and memory
            decode(item, prefill(item, prompt), 1)
            with PeakRss() as peak:
                decode(item, prefill(item, prompt), settings.decode)
            item.forward_peak_mib = peak.mib
        times: dict[str, dict[str, list[float]]] = {p: {"prefill": [], "decode": []} for p in loaded}
        order = random.Random(0)
        names = list(loaded)
        for _ in _progress(range(settings.rounds), desc="rounds"):
            order.shuffle(names)
            for name in names:
                item = loaded[name]
                begin = time.perf_counter()
                token = prefill(item, prompt)
                middle = time.perf_counter()
                decode(item, token, settings.decode)
                end = time.perf_counter()
                times[name]["prefill"].append(settings.prompt / (middle - begin))
                times[name]["decode"].append(settings.decode / (end - middle))

    stock = loaded["stock"]
    for name, item in loaded.items():
        for phase, tokens in (("prefill", settings.prompt), ("decode", settings.decode)):
            speeds = times[name][phase]
            add(name, tokens, f"{phase}_tokens_per_s", _quantiles(speeds))
            paired = [s / r for s, r in zip(speeds, times["stock"][phase], strict=True)]
            add(name, tokens, f"{phase}_speedup_vs_stock", _quantiles(paired))
        for metric in ("footprint_mib", "load_peak_mib", "forward_peak_mib"):
            value = getattr(item, metric)
            add(name, "-", metric, (value,) * 3)
            reference = getattr(stock, metric)
            ratio = value / reference if reference > 0 else float("nan")
            add(name, "-", metric.replace("_mib", "_vs_stock"), (ratio,) * 3)
    return rows


def print_table(rows: Sequence[dict[str, object]]) -> None:
    table: dict[str, dict[str, float]] = {}
    for r in rows:
        table.setdefault(str(r["provider"]), {})[str(r["metric"])] = float(r["median"])
    columns = (
        ("prefill tok/s", "prefill_tokens_per_s", "{:.1f}"),
        ("x stock", "prefill_speedup_vs_stock", "{:.2f}"),
        ("decode tok/s", "decode_tokens_per_s", "{:.2f}"),
        ("x stock", "decode_speedup_vs_stock", "{:.2f}"),
        ("weights MiB", "footprint_mib", "{:.0f}"),
        ("/ stock", "footprint_vs_stock", "{:.2f}"),
        ("load peak MiB", "load_peak_mib", "{:.0f}"),
        ("run peak MiB", "forward_peak_mib", "{:.0f}"),
    )
    print(f"{'provider':20}" + "".join(f"{title:>15}" for title, _, _ in columns))
    for provider, metrics in table.items():
        cells = [fmt.format(metrics[m]) if m in metrics else "-" for _, m, fmt in columns]
        print(f"{provider:20}" + "".join(f"{c:>15}" for c in cells))


def write_csv(rows: Sequence[dict[str, object]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, **{k: f"{float(r[k]):.6g}" for k in ("median", "p20", "p80")}})


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="1 layer, 16-token prompt, 4 decode steps, 2 rounds"
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny test model instead of the real shapes")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=None, help="prefill tokens")
    parser.add_argument("--decode", type=int, default=None, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--out",
        default=str(HERE.parent / "bench-out" / "model.csv"),
        help="a CSV file, or a folder (one that exists, or a path ending with /) to get model.csv",
    )
    args = parser.parse_args(argv)
    args.out = csv_path(args.out, "model.csv")
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = Settings.quick(args.tiny) if args.quick else Settings(tiny=args.tiny)
    overrides = {k: getattr(args, k) for k in ("layers", "vocab", "prompt", "decode", "rounds")}
    settings = Settings(**{**settings.__dict__, **{k: v for k, v in overrides.items() if v is not None}})
    from transformers.utils import logging

    logging.set_verbosity_error()
    print(f"# {machine_label()}")
    rows = sweep(settings, args.providers)
    write_csv(rows, args.out)
    print_table(rows)
    print(f"# wrote {args.out}")


if __name__ == "__main__":
    main()
