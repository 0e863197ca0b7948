"""Stock attention vs FusedQKVAttention at real model shapes, side by side in one run, on random weights.

    python benchmarks/bench_attention.py [--csv out.csv] [--tokens 1 16] [--dtypes bf16] [--threads 1] [--device cuda]
    pytest benchmarks/bench_attention.py --benchmark-enable    # a few points, as pytest-benchmark cases

Shapes: Llama-3.2-1B and Qwen3-30B-A3B from model_shapes.json (shipped in layerswap/data;
$LAYERSWAP_MODEL_SHAPES overrides it); fp32 and bf16; batch 1, T tokens, no cache, sdpa. Two kernels: `qkv_proj` (the three
stock projections vs `project_qkv`) and `attention` (the whole module forward). Stock and fused take turns
sample by sample, so a busy machine slows both alike: read the fused/stock ratios (median and p20/p80 of the
per-round ratios), not raw times across runs. For `qkv_proj` the run also measures this machine's limit,
max(weight bytes / copy bandwidth, FLOPs / large-GEMM rate), as provider `roofline`.
CSV columns: kernel, provider, shape, dtype, T, metric, median, p20, p80, device.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import itertools
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
try:
    import layerswap  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT / "src"))

from layerswap.bundle import BundleOptions  # noqa: E402
from layerswap.shapes import model_shape  # noqa: E402
from layerswap.swaps.fused_qkv.modules import FusedQKVAttention, fused_qkv_adapter  # noqa: E402
from machine import KERNEL_FIELDS  # noqa: E402

SHAPES = ("meta-llama/Llama-3.2-1B", "Qwen/Qwen3-30B-A3B")
TOKENS = (1, 4, 16, 64, 512)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_ATTENTION_CLASS = {"llama": "LlamaAttention", "qwen3_moe": "Qwen3MoeAttention"}
CSV_FIELDS = KERNEL_FIELDS


@dataclass
class Layers:
    """`len(stock)` stock attention modules of one shape and their fused twins (same weights). Calls cycle
    through them, so each call reads its weights from memory, as in a real model whose layers do not all fit in
    the CPU cache (one layer would: decode would then look compute-bound when it is bandwidth-bound)."""

    config: Any
    stock: list[torch.nn.Module]
    fused: list[FusedQKVAttention]
    rotary: torch.nn.Module
    dtype: torch.dtype


def _layer_bytes(config: Any, dtype: torch.dtype) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return (2 * q + 2 * kv) * config.hidden_size * dtype.itemsize


def build_layers(
    shape_name: str, dtype: torch.dtype, working_set_mb: float, seed: int = 0, device: str = "cpu"
) -> Layers:
    fields = model_shape(shape_name)
    model_type = fields.pop("model_type")
    fields.pop("torch_dtype", None)
    config = AutoConfig.for_model(model_type, **fields)
    config._attn_implementation = "sdpa"
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    stock_class = getattr(modeling, _ATTENTION_CLASS[model_type])
    rotary_class = next(v for k, v in vars(modeling).items() if k.endswith("RotaryEmbedding"))
    fused_class = fused_qkv_adapter(stock_class, BundleOptions())
    copies = max(1, math.ceil(working_set_mb * 2**20 / _layer_bytes(config, dtype)))
    torch.manual_seed(seed)
    stock, fused = [], []
    with torch.no_grad():
        for _ in range(copies):
            layer = stock_class(config, layer_idx=0).to(device=device, dtype=dtype).eval()
            twin = fused_class(config, layer_idx=0).to(device=device, dtype=dtype).eval()
            state = layer.state_dict()
            for parameter in ("weight", "bias"):
                parts = [state.pop(f"{name}.{parameter}", None) for name in ("q_proj", "k_proj", "v_proj")]
                if parts[0] is not None:
                    state[f"qkv_proj.{parameter}"] = torch.cat(parts)
            twin.load_state_dict(state, strict=True)
            stock.append(layer)
            fused.append(twin)
    return Layers(config, stock, fused, rotary_class(config).to(device), dtype)


def _stock_qkv(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return module.q_proj(x), module.k_proj(x), module.v_proj(x)


def _fused_qkv(module: FusedQKVAttention, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return module.project_qkv(x)


def workloads(layers: Layers, tokens: int, seed: int = 1) -> dict[tuple[str, str], Callable[[], Any]]:
    generator = torch.Generator().manual_seed(seed)
    device = layers.stock[0].q_proj.weight.device
    x = torch.randn(1, tokens, layers.config.hidden_size, generator=generator).to(
        device=device, dtype=layers.dtype
    )
    cos, sin = layers.rotary(x, torch.arange(tokens, device=device)[None])
    pe = (cos.to(layers.dtype), sin.to(layers.dtype))
    cycles = {name: itertools.cycle(getattr(layers, name)) for name in ("stock", "fused")}
    return {
        ("qkv_proj", "stock"): lambda: _stock_qkv(next(cycles["stock"]), x),
        ("qkv_proj", "fused"): lambda: _fused_qkv(next(cycles["fused"]), x),
        ("attention", "stock"): lambda: next(cycles["stock"])(x, pe, None),
        ("attention", "fused"): lambda: next(cycles["fused"])(x, pe, None),
    }


def _synchronize(device: str) -> None:
    """Wait for queued GPU work, so that perf_counter brackets the kernels and not just their launches."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _inner_loops(function: Callable[[], Any], device: str, target_s: float = 0.02) -> int:
    _synchronize(device)
    start = time.perf_counter()
    function()
    _synchronize(device)
    elapsed = max(time.perf_counter() - start, 1e-6)
    return max(1, min(200, int(target_s / elapsed)))


def measure(
    functions: dict[str, Callable[[], Any]], repeats: int, device: str = "cpu"
) -> dict[str, list[float]]:
    """Per-call milliseconds, `repeats` samples each; the providers take turns inside every round. On CUDA each
    sample is bracketed by synchronisations."""
    with torch.inference_mode():
        for function in functions.values():
            for _ in range(3):
                function()
        loops = {name: _inner_loops(function, device) for name, function in functions.items()}
        samples: dict[str, list[float]] = {name: [] for name in functions}
        order = list(functions)
        for _ in range(repeats):
            order.reverse()  # neither provider always runs first (warm caches, turbo state)
            for name in order:
                function = functions[name]
                _synchronize(device)
                start = time.perf_counter()
                for _ in range(loops[name]):
                    function()
                _synchronize(device)
                samples[name].append((time.perf_counter() - start) * 1e3 / loops[name])
    return samples


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return statistics.median(values), cuts[1], cuts[7]


def machine_limits(dtype: torch.dtype, working_set_mb: float, device: str = "cpu") -> tuple[float, float]:
    """(copy bandwidth in bytes/ms over `working_set_mb`, large-GEMM rate in FLOP/ms) of this device, now."""
    with torch.inference_mode():
        numel = max(1, int(max(working_set_mb, 64) * 2**20) // dtype.itemsize)
        source = torch.empty(numel, dtype=dtype, device=device).normal_()
        target = torch.empty_like(source)
        a, b = (torch.randn(2048, 2048, dtype=dtype, device=device) for _ in range(2))
        samples = measure(
            {"copy": lambda: target.copy_(source), "gemm": lambda: a @ b}, repeats=7, device=device
        )
    copy_ms, gemm_ms = (statistics.median(samples[name]) for name in ("copy", "gemm"))
    return 2 * source.numel() * dtype.itemsize / copy_ms, 2 * 2048**3 / gemm_ms


def roofline_ms(layers: Layers, tokens: int, limits: tuple[float, float]) -> float:
    """The qkv projection's floor on this machine: reading its weights, or its FLOPs at the large-GEMM rate."""
    bandwidth, gemm_rate = limits
    weight = layers.fused[0].qkv_proj.weight
    return max(weight.numel() * weight.element_size() / bandwidth, 2 * tokens * weight.numel() / gemm_rate)


def device_label(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def sweep(
    shapes: tuple[str, ...],
    dtypes: tuple[str, ...],
    tokens: tuple[int, ...],
    repeats: int,
    working_set_mb: float,
    device: str = "cpu",
) -> Iterator[dict]:
    label = device_label(device)
    for dtype_name in dtypes:
        limits = machine_limits(DTYPES[dtype_name], working_set_mb, device)
        for shape in shapes:
            layers = build_layers(shape, DTYPES[dtype_name], working_set_mb, device=device)
            for t in tokens:
                jobs = workloads(layers, t)
                common = dict(shape=shape, dtype=dtype_name, T=t, device=label)
                for kernel in ("qkv_proj", "attention"):
                    samples = measure({p: jobs[(kernel, p)] for p in ("stock", "fused")}, repeats, device)
                    ratios = [f / s for f, s in zip(samples["fused"], samples["stock"], strict=True)]
                    for provider, values, metric in (
                        ("stock", samples["stock"], "ms"),
                        ("fused", samples["fused"], "ms"),
                        ("fused/stock", ratios, "ratio"),
                    ):
                        median, p20, p80 = _quantiles(values)
                        yield dict(
                            kernel=kernel,
                            provider=provider,
                            metric=metric,
                            median=median,
                            p20=p20,
                            p80=p80,
                            **common,
                        )
                    if kernel == "qkv_proj":
                        limit = roofline_ms(layers, t, limits)
                        yield dict(
                            kernel=kernel,
                            provider="roofline",
                            metric="ms",
                            median=limit,
                            p20=limit,
                            p80=limit,
                            **common,
                        )
            del layers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=Path("bench_attention.csv"))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--working-set-mb",
        type=float,
        default=1024,
        help="weights cycled through per provider; above the CPU's last-level cache (default 1024)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra brings tqdm; without it, no progress bar

        def tqdm(iterable: Any, **_: Any) -> Any:
            return iterable

    rows = []
    total = len(args.shapes) * len(args.dtypes) * len(args.tokens) * 7
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is present (torch.cuda.is_available() is False)")
    points = sweep(
        tuple(args.shapes),
        tuple(args.dtypes),
        tuple(args.tokens),
        args.repeats,
        args.working_set_mb,
        args.device,
    )
    for row in tqdm(points, total=total):
        rows.append(row)
    with args.csv.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"{rows[0]['device']}; ms are medians, the ratio is the median [p20, p80] of per-round fused/stock")
    print(
        f"{'kernel':<10} {'shape':<14} {'dtype':<5} {'T':>4}  {'stock ms':>9} {'fused ms':>9} {'limit ms':>9}"
        "  fused/stock"
    )
    by_key = {(r["kernel"], r["shape"], r["dtype"], r["T"], r["provider"]): r for r in rows}
    for r in rows:
        if r["provider"] != "fused/stock":
            continue
        key = (r["kernel"], r["shape"], r["dtype"], r["T"])
        stock, fused = by_key[(*key, "stock")]["median"], by_key[(*key, "fused")]["median"]
        limit = by_key.get((*key, "roofline"), {}).get("median")
        limit_text = f"{limit:>9.3f}" if limit is not None else f"{'':>9}"
        print(
            f"{r['kernel']:<10} {r['shape'].split('/')[-1][:14]:<14} {r['dtype']:<5} {r['T']:>4}  {stock:>9.3f} "
            f"{fused:>9.3f} {limit_text}  {r['median']:.3f} [{r['p20']:.3f}, {r['p80']:.3f}]"
        )
    print(f"wrote {args.csv}", file=sys.stderr)


# --- pytest-benchmark cases (a few points of the sweep; `main()` runs all of it) ---------------------------------

try:
    import pytest
except ImportError:  # running main() without pytest installed
    pytest = None

if pytest is not None:

    @pytest.mark.parametrize("provider", ["stock", "fused"])
    @pytest.mark.parametrize("kernel", ["qkv_proj", "attention"])
    @pytest.mark.parametrize("tokens", [1, 64])
    @pytest.mark.parametrize("dtype_name", list(DTYPES))
    @pytest.mark.parametrize("shape", SHAPES)
    def test_attention(
        benchmark: Any, shape: str, dtype_name: str, tokens: int, kernel: str, provider: str
    ) -> None:
        benchmark.group = f"{kernel} {shape} {dtype_name} T={tokens}"
        # One layer (fits in cache): these cases track regressions; main() measures from memory.
        layers = build_layers(shape, DTYPES[dtype_name], working_set_mb=0)
        function = workloads(layers, tokens)[(kernel, provider)]
        with torch.inference_mode():
            benchmark(function)


if __name__ == "__main__":
    main()
