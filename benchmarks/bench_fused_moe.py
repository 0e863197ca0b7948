"""Fused MoE experts vs the stock transformers backends, at real model shapes, against the machine's roofline.

    python benchmarks/bench_fused_moe.py                     # CPU sweep: 2 shapes x fp32/bf16 x T in 1..512
    python benchmarks/bench_fused_moe.py --tokens 1 16 --dtypes bfloat16 --out bench-out/moe.csv
    pytest benchmarks/bench_fused_moe.py --benchmark-enable  # small pytest-benchmark suite

One experts module (`<Family>Experts`, weights from torch.randn, never downloaded) per shape from
model_shapes.json (shipped in layerswap/data; $LAYERSWAP_MODEL_SHAPES overrides it). Providers:
stock eager, grouped_mm, batched_mm; layerswap (`fused_experts_forward` -> `fused_moe`, backend
chosen automatically: Triton on CUDA, on CPU the strategy this machine calibrated, see
layerswap.kernels.cpu_dispatch); quant (the `<model_type>-quant` bundle's LinearExperts, one nn.Linear per
projection, on the same weights, unquantized); and, on request only, ls-stock / ls-layerswap / ls-upcast
(layerswap with LAYERSWAP_CPU_STRATEGY forcing one CPU strategy, to see every branch side by side). In the same run
it measures the machine's memory bandwidth and plain-GEMM throughput, and reports each time as a ratio to the
best stock backend and as a share of the roofline max(active-expert bytes / bandwidth, FLOPs / GEMM rate).
Routing is uniform random top-k, a different draw for consecutive calls, and a 512 MiB buffer is written
before each timed call, so every call reads its experts' weights from memory (as in a real forward pass).
CSV columns: kernel, provider, shape, dtype, T, metric, median, p20, p80, device, plan (the CPU strategy the
layerswap provider ran; for quant, the engines its experts ran), then the machine (benchmarks/machine.py):
cpu_model, cpu_flags, isa_limits, cpu_cores, threads, torch, transformers.
"""

from __future__ import annotations

import argparse
import copy
import csv
import importlib
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
try:
    import layerswap
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT / "src"))

sys.path.insert(0, str(Path(__file__).resolve().parent))
import layerswap  # noqa: E402
from layerswap.kernels import cpu_dispatch, plan_for  # noqa: E402
from layerswap.kernels._cpu_strategies import describe_ops  # noqa: E402
from layerswap.shapes import model_shape  # noqa: E402
from layerswap.swaps.fast.modules import fused_experts_forward  # noqa: E402
from machine import KERNEL_FIELDS, MACHINE_FIELDS, csv_path, machine_fields, machine_label  # noqa: E402

SHAPES = {"qwen1.5-moe-a2.7b": "Qwen/Qwen1.5-MoE-A2.7B", "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B"}
STOCK = ("eager", "grouped_mm", "batched_mm")
PROVIDERS = (*STOCK, "layerswap", "quant")
FORCED = {"ls-stock": "stock", "ls-layerswap": "layerswap", "ls-upcast": "upcast"}  # on request only
CSV_FIELDS = (
    *KERNEL_FIELDS,
    "plan",
    *MACHINE_FIELDS,
)
ROUTING_DRAWS = 7  # more than the providers, so that consecutive calls never share a routing


@dataclass(frozen=True)
class ExpertsShape:
    name: str
    model_type: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    hidden_act: str = "silu"

    def expert_bytes(self, dtype: torch.dtype) -> int:
        return 3 * self.hidden * self.intermediate * dtype.itemsize

    def flops(self, num_tokens: int) -> int:
        return num_tokens * self.top_k * 3 * 2 * self.hidden * self.intermediate


SMALL = ExpertsShape("small", "qwen2_moe", num_experts=16, top_k=4, hidden=256, intermediate=128)


def load_shapes(names: Sequence[str]) -> list[ExpertsShape]:
    shapes = []
    for name in names:
        if name == "small":  # not a model: the smoke-test size (tests run the script with it)
            shapes.append(SMALL)
            continue
        config = model_shape(SHAPES[name])
        shapes.append(
            ExpertsShape(
                name,
                config["model_type"],
                config["num_experts"],
                config["num_experts_per_tok"],
                config["hidden_size"],
                config["moe_intermediate_size"],
                config.get("hidden_act", "silu"),
            )
        )
    return shapes


def experts_class(model_type: str) -> type[nn.Module]:
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    found = [v for k, v in vars(module).items() if k.endswith("Experts") and isinstance(v, type)]
    if len(found) != 1:
        raise SystemExit(
            f"expected one *Experts class in {module.__name__}, found {[c.__name__ for c in found]}"
        )
    return found[0]


def build_experts(shape: ExpertsShape, dtype: torch.dtype, device: torch.device) -> nn.Module:
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        shape.model_type,
        hidden_size=shape.hidden,
        moe_intermediate_size=shape.intermediate,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k,
        hidden_act=shape.hidden_act,
    )
    with torch.device("meta"):  # no fp32 staging copy of the 1-2.5 GB of weights
        experts = experts_class(shape.model_type)(config)
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    # Filled one expert at a time (randn of the whole tensor would need an fp32 copy); scaled so the
    # activations stay O(1), as in a trained model.
    gate_up = torch.empty(e, 2 * i, h, dtype=dtype, device=device)
    down = torch.empty(e, h, i, dtype=dtype, device=device)
    for expert in range(e):
        gate_up[expert].normal_(0.0, h**-0.5)
        down[expert].normal_(0.0, i**-0.5)
    experts.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
    experts.down_proj = nn.Parameter(down, requires_grad=False)
    return experts


def build_quant_experts(shape: ExpertsShape, experts: nn.Module) -> nn.Module:
    """The `<model_type>-quant` bundle's LinearExperts on `experts`' weights (views, no copy), unquantized: what
    a -quant model runs before a quantizer replaces its nn.Linear layers."""
    bundle = layerswap.get_bundle(f"{shape.model_type}-quant")
    original = type(experts)
    patch = next(p for p in bundle.patches if p.class_name == original.__name__)
    quant_class = patch.adapter(original, bundle.make_options({}))
    config = copy.deepcopy(
        experts.config
    )  # its own: the stock providers switch experts_implementation on theirs
    config._experts_implementation = "eager"
    with torch.device("meta"):
        quant = quant_class(config)
    intermediate = shape.intermediate
    for index, expert in enumerate(quant):
        names = expert.names
        weights = {
            names.gate: experts.gate_up_proj[index, :intermediate],
            names.up: experts.gate_up_proj[index, intermediate:],
            names.down: experts.down_proj[index],
        }
        for name, weight in weights.items():
            getattr(expert, name).weight = nn.Parameter(weight, requires_grad=False)
    return quant


def make_inputs(shape: ExpertsShape, num_tokens: int, dtype: torch.dtype, device: torch.device, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, shape.hidden, generator=generator).to(device, dtype)
    scores = torch.rand(num_tokens, shape.num_experts, generator=generator)
    weights, index = scores.topk(shape.top_k, dim=-1)  # distinct experts per token, like a router
    return x, index.to(device), (weights / weights.sum(-1, keepdim=True)).to(device, dtype)


def provider_fn(name: str, quant: nn.Module | None = None) -> Callable[..., torch.Tensor]:
    if name == "layerswap":
        return fused_experts_forward  # what experts_implementation="layerswap" runs
    if name == "quant":
        return lambda m, x, i, w: quant(x, i, w)
    if name in FORCED:

        def forced(m: nn.Module, x: torch.Tensor, i: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            previous = os.environ.get("LAYERSWAP_CPU_STRATEGY")
            os.environ["LAYERSWAP_CPU_STRATEGY"] = FORCED[name]
            try:
                return fused_experts_forward(m, x, i, w)
            finally:
                if previous is None:
                    del os.environ["LAYERSWAP_CPU_STRATEGY"]
                else:
                    os.environ["LAYERSWAP_CPU_STRATEGY"] = previous

        return forced

    def stock(m: nn.Module, x: torch.Tensor, i: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m.config._experts_implementation = name
        return m(x, i, w)

    return stock


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_one_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)
    begin_s = time.perf_counter()
    fn()
    return (time.perf_counter() - begin_s) * 1e3


def time_interleaved(
    calls: dict[str, Callable[[int], object]],
    device: torch.device,
    reps: int,
    budget_s: float,
    between: Callable[[], object] | None = None,
    max_reps: int = 200,
) -> dict[str, list[float]]:
    """Per-call ms for each provider, taking turns call by call (in an order shuffled every round), so
    that load from other processes on a shared machine hits every provider alike and the ratios stay
    meaningful. `fn(i)` runs the i-th call of the whole run, so consecutive calls (of different providers)
    can use different routings; `between` (e.g. a cache flush) runs untimed before each call. At least
    `reps` rounds, then more (up to `max_reps`) while `budget_s` lasts: short calls get more samples."""
    for fn in calls.values():
        fn(0)  # warm-up: first-call allocations, Triton compilation
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in calls}
    started = time.perf_counter()
    call_index = 0
    names = list(calls)
    order = random.Random(0)
    for rep in range(max(reps, max_reps)):
        # Shuffled each round: no provider always runs right after the same other one (e.g. batched_mm, which
        # allocates and frees gigabytes).
        order.shuffle(names)
        for name in names:
            fn = calls[name]
            if between is not None:
                between()
                _sync(device)
            times[name].append(_time_one_ms(lambda fn=fn, i=call_index: fn(i), device))
            call_index += 1
        if rep + 1 >= reps and time.perf_counter() - started > budget_s:
            break
    return times


class CacheFlush:
    """Overwrites a buffer larger than the last-level cache, so each timed call reads its experts' weights
    from memory, as in a real forward pass where the other layers' weights evict them. Without it, a
    provider timed right after another one on the same routing finds that routing's experts still cached."""

    def __init__(self, device: torch.device, mib: int) -> None:
        self.buffer = torch.empty(mib * 2**20 // 4, device=device) if mib > 0 else None

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.fill_(1.0)


def summarize(values: Sequence[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=10, method="inclusive")
    return statistics.median(values), q[1], q[7]


@dataclass(frozen=True)
class MachineLimits:
    device_name: str
    bandwidth_gbs: float
    gemm_gflops: dict[torch.dtype, float]

    def roofline_ms(
        self, shape: ExpertsShape, dtype: torch.dtype, num_tokens: int, active_experts: float
    ) -> float:
        memory = active_experts * shape.expert_bytes(dtype) / self.bandwidth_gbs / 1e6
        compute = shape.flops(num_tokens) / self.gemm_gflops[dtype] / 1e6
        return max(memory, compute)


def _median_ms(fn: Callable[[], object], device: torch.device, reps: int = 10) -> float:
    return summarize(time_interleaved({"x": lambda _: fn()}, device, reps, 2.0, max_reps=reps)["x"])[0]


def measure_machine(dtypes: Sequence[torch.dtype], device: torch.device) -> MachineLimits:
    """Streaming-read bandwidth (the better of a reduction and a GEMV over buffers far larger than cache)
    and square-GEMM throughput per dtype, measured now, on this machine as loaded as the sweep will be."""
    numel = (256 if device.type == "cuda" else 128) * 2**20  # 1 GiB / 512 MiB of fp32
    buffer = torch.randn(numel, device=device)
    vector = torch.randn(8192, device=device)
    read_ms = min(
        _median_ms(buffer.sum, device), _median_ms(lambda: torch.mv(buffer.view(-1, 8192), vector), device)
    )
    gemm = {}
    for dtype in dict.fromkeys([torch.float32, *dtypes]):
        gemm[dtype] = _gemm_gflops(dtype, device)
    if device.type == "cpu":
        # Where torch's reduced-precision GEMM is emulated (AVX2-only CPUs: ~1% of the fp32 rate), converting to
        # fp32 and running the fp32 GEMM is the machine's real limit for that dtype.
        gemm = {d: max(g, gemm[torch.float32]) for d, g in gemm.items()}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()}"
    return MachineLimits(name, numel * 4 / read_ms / 1e6, {d: gemm[d] for d in dtypes})


def _gemm_gflops(dtype: torch.dtype, device: torch.device) -> float:
    """Square-GEMM throughput, at the size (up to 8192 on a GPU, 2048-4096 on a CPU) where one call takes
    about 50 ms or more, so that a slow (emulated) dtype does not take minutes."""
    largest = 8192 if device.type == "cuda" else (2048 if dtype == torch.float32 else 4096)
    n = 256
    while True:
        a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
        ms = _median_ms(lambda a=a, b=b: torch.mm(a, b), device, reps=3 if n < largest else 10)
        if n >= largest or ms > 50:
            return 2 * n**3 / ms / 1e6
        n *= 2


def row(kernel, provider, shape, dtype, tokens, metric, stats, device, plan="-") -> dict[str, object]:
    median, p20, p80 = stats
    return dict(
        zip(
            CSV_FIELDS,
            (
                kernel,
                provider,
                shape,
                str(dtype).removeprefix("torch."),
                tokens,
                metric,
                f"{median:.6g}",
                f"{p20:.6g}",
                f"{p80:.6g}",
                device,
                plan,
                *machine_fields().values(),
            ),
            strict=True,
        )
    )


def case_rows(
    experts: nn.Module,
    shape: ExpertsShape,
    dtype: torch.dtype,
    num_tokens: int,
    providers: Sequence[str],
    limits: MachineLimits,
    device: torch.device,
    reps: int,
    budget_s: float,
    gather_limit_gib: float,
    flush: CacheFlush,
    quant: nn.Module | None = None,
) -> list[dict[str, object]]:
    """Latency, ratio to the best stock backend and roofline share of every provider at one (shape, dtype, T)."""
    draws = [make_inputs(shape, num_tokens, dtype, device, seed) for seed in range(ROUTING_DRAWS)]
    active = statistics.mean(float(index.unique().numel()) for _, index, _ in draws)
    roofline = limits.roofline_ms(shape, dtype, num_tokens, active)
    calls = {}
    for provider in providers:
        # batched_mm gathers a copy of both weights per pair ([T*K, 2I, H] and [T*K, H, I], alive together):
        # past the limit it takes seconds per call and its allocations disturb the providers timed after it.
        gathered = num_tokens * shape.top_k * shape.expert_bytes(dtype)
        if provider == "batched_mm" and gathered > gather_limit_gib * 2**30:
            print(
                f"# skip batched_mm {shape.name} {dtype} T={num_tokens}: it would gather "
                f"{gathered / 2**30:.1f} GiB of weights",
                file=sys.stderr,
            )
            continue
        fn = provider_fn(provider, quant)
        calls[provider] = lambda i, fn=fn: fn(experts, *draws[i % ROUTING_DRAWS])
    with torch.inference_mode():
        timed = time_interleaved(calls, device, reps, budget_s, between=flush)  # the warm-up calibrates
        plans = {}  # what each of layerswap's providers ran, as its CPU dispatch decided
        if device.type == "cpu":
            x, index, _ = draws[0]
            if "layerswap" in calls:
                plans["layerswap"] = plan_for(x, experts.gate_up_proj, experts.down_proj, index).describe()
            if "quant" in calls:
                # None: every expert runs its nn.Linear modules, which is engine "row" at every row count
                engines = quant._cpu_engines(x) or cpu_dispatch.ALL_ROW
                plans["quant"] = f"engines({describe_ops(engines)})"
    stats = {p: summarize(t) for p, t in timed.items()}

    where = (shape.name, dtype, num_tokens)
    rows = [row("moe_experts", "roofline", *where, "ms", (roofline,) * 3, limits.device_name)]
    best_stock = min((stats[p][0] for p in STOCK if p in stats), default=None)
    for provider, (median, p20, p80) in stats.items():
        plan_used = plans.get(provider, "-")
        rows.append(
            row(
                "moe_experts",
                provider,
                *where,
                "latency_ms",
                (median, p20, p80),
                limits.device_name,
                plan_used,
            )
        )
        share = (roofline / median, roofline / p80, roofline / p20)
        rows.append(row("moe_experts", provider, *where, "roofline_share", share, limits.device_name))
        if best_stock is not None:
            ratio = (median / best_stock, p20 / best_stock, p80 / best_stock)
            rows.append(
                row("moe_experts", provider, *where, "ratio_vs_best_stock", ratio, limits.device_name)
            )
    return rows


def sweep(
    shapes: Sequence[ExpertsShape],
    dtypes: Sequence[torch.dtype],
    tokens: Sequence[int],
    providers: Sequence[str],
    device: torch.device,
    reps: int,
    budget_s: float,
    gather_limit_gib: float,
    flush_mib: int,
) -> list[dict[str, object]]:
    limits = measure_machine(dtypes, device)
    flush = CacheFlush(device, flush_mib)
    print(
        f"# {limits.device_name}: {limits.bandwidth_gbs:.1f} GB/s; "
        + ", ".join(f"{d}: {g:.0f} GFLOP/s" for d, g in limits.gemm_gflops.items())
    )
    rows = [
        row(
            "machine",
            "memory_bandwidth",
            "-",
            "-",
            "-",
            "GB/s",
            (limits.bandwidth_gbs,) * 3,
            limits.device_name,
        )
    ]
    rows += [
        row("machine", "gemm", "-", d, "-", "GFLOP/s", (g,) * 3, limits.device_name)
        for d, g in limits.gemm_gflops.items()
    ]
    try:
        from tqdm import tqdm
    except ImportError:

        def tqdm(iterable, **_):
            return iterable

    print(f"# {machine_label()}")
    cases = [(s, d, t) for s in shapes for d in dtypes for t in tokens]
    experts, quant, built_for = None, None, None
    for shape, dtype, num_tokens in tqdm(cases, desc="fused_moe sweep", file=sys.stderr):
        if built_for != (shape, dtype):
            experts = quant = None  # free the previous 1-2.5 GB before building the next
            experts, built_for = build_experts(shape, dtype, device), (shape, dtype)
            quant = build_quant_experts(shape, experts) if "quant" in providers else None
        rows += case_rows(
            experts,
            shape,
            dtype,
            num_tokens,
            providers,
            limits,
            device,
            reps,
            budget_s,
            gather_limit_gib,
            flush,
            quant,
        )
    return rows


def print_table(rows: Sequence[dict[str, object]]) -> None:
    """One line per (shape, dtype, T): each provider's median ms, layerswap's ratio and roofline share."""
    table: dict[tuple, dict[str, dict[str, object]]] = {}
    for r in rows:
        if r["kernel"] == "moe_experts":
            table.setdefault((r["shape"], r["dtype"], r["T"]), {}).setdefault(r["provider"], {})[
                r["metric"]
            ] = r["median"]
    shown = [p for p in (*PROVIDERS, *FORCED) if any(p in by for by in table.values())]
    ratios = [p for p in shown if p not in STOCK]
    plans = {
        (r["shape"], r["dtype"], r["T"]): r["plan"]
        for r in rows
        if r["provider"] == "layerswap" and r.get("plan", "-") != "-"
    }
    print(
        f"{'shape':18} {'dtype':9} {'T':>5} | "
        + " ".join(f"{p:>10}" for p in shown)
        + f" | {'roofline':>8} | "
        + " ".join(f"{p + '/best':>14}" for p in ratios)
        + f" | {'layerswap roofline share':>14} | plan"
    )
    for (shape, dtype, tokens), by_provider in table.items():
        ms = " ".join(f"{by_provider.get(p, {}).get('latency_ms', '-'):>10}" for p in shown)
        ratio = " ".join(f"{by_provider.get(p, {}).get('ratio_vs_best_stock', '-'):>14}" for p in ratios)
        ours = by_provider.get("layerswap", {})
        print(
            f"{shape:18} {dtype:9} {tokens:>5} | {ms} | {by_provider['roofline']['ms']:>8} | {ratio} | "
            f"{ours.get('roofline_share', '-'):>14} | {plans.get((shape, dtype, tokens), '-')}"
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=list(SHAPES),
        choices=[*SHAPES, "small"],
        help="model shapes (default: all); 'small' is a 16-expert toy for smoke tests",
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 128, 512])
    parser.add_argument(
        "--providers",
        nargs="+",
        default=list(PROVIDERS),
        choices=[*PROVIDERS, *FORCED],
        help="ls-stock / ls-layerswap / ls-upcast force one CPU strategy of layerswap's (not in the default)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=5, help="at least this many timed calls per provider")
    parser.add_argument(
        "--budget",
        type=float,
        default=6.0,
        help="then more calls (up to 200) while this many seconds last, per shape, dtype and T",
    )
    parser.add_argument(
        "--batched-mm-limit-gib",
        type=float,
        default=1.0,
        help="skip batched_mm where its gathered weight copy would exceed this",
    )
    parser.add_argument(
        "--flush-mib",
        type=int,
        default=512,
        help="cache-flush buffer written before each timed call (0: no flush)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's); 1 is steadier on a shared machine",
    )
    parser.add_argument(
        "--out",
        default=str(REPO_ROOT / "bench-out" / "fused_moe.csv"),
        help="a CSV file, or a folder (one that exists, or a path ending with /) to get fused_moe.csv",
    )
    args = parser.parse_args(argv)
    args.out = csv_path(args.out, "fused_moe.csv")

    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, name) for name in args.dtypes]
    rows = sweep(
        load_shapes(args.shapes),
        dtypes,
        args.tokens,
        args.providers,
        torch.device(args.device),
        args.reps,
        args.budget,
        args.batched_mm_limit_gib,
        args.flush_mib,
    )
    with args.out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print_table(rows)
    print(f"# wrote {args.out}")


# pytest-benchmark suite: a small shape by default, so `pytest benchmarks/` stays quick; LAYERSWAP_BENCH_FULL=1
# times the Qwen1.5-MoE-A2.7B experts instead.
try:
    import pytest
except ImportError:  # the script itself needs no pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="module")
    def bench_shape() -> ExpertsShape:
        return load_shapes(["qwen1.5-moe-a2.7b"])[0] if os.environ.get("LAYERSWAP_BENCH_FULL") else SMALL

    @pytest.mark.parametrize("num_tokens", [1, 64])
    @pytest.mark.parametrize("provider", ["eager", "grouped_mm", "layerswap"])
    def test_experts_latency(benchmark, bench_shape: ExpertsShape, provider: str, num_tokens: int) -> None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        experts = build_experts(bench_shape, torch.float32, device)
        inputs = make_inputs(bench_shape, num_tokens, torch.float32, device, seed=0)
        fn = provider_fn(provider)

        def call() -> torch.Tensor:
            with torch.inference_mode():
                out = fn(experts, *inputs)
            _sync(device)
            return out

        benchmark(call)


if __name__ == "__main__":
    main()
