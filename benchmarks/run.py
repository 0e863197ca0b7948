"""layerswap benchmarks in one run: stock transformers vs each bundle, side by side, as one CSV and PNG plots.

    python benchmarks/run.py --suite all --quick          # from a source checkout
    python benchmarks/run.py --suite moe --device cuda --out bench-out/gpu

Suites (each reuses the sweep of its own module, which can also run alone):
  moe        stock experts backends (eager, grouped_mm, batched_mm) vs layerswap's fused experts, and the
             machine's roofline, at Qwen1.5-MoE-A2.7B / Qwen3-30B-A3B expert shapes   (bench_fused_moe.py)
  attention  stock attention vs the fused_qkv bundle's FusedQKVAttention, Llama-3.2-1B / Qwen3-30B-A3B shapes,
             q/k/v projection alone and the whole module, and the projection's roofline (bench_attention.py)
  memory     weight footprint of every model in model_shapes.json, bf16 / nf4 / int8, stock vs -quant (memory.py)
  load       from_pretrained wall time and peak RSS, stock vs qwen2_moe-quant, fresh process per load (load.py)
  model      whole-model prefill and decode tokens/s and memory of a 2-layer Qwen1.5-MoE-A2.7B-shaped model:
             stock bf16 vs -quant (bf16, bitsandbytes nf4 / int8, torchao int8) and -fast   (bench_model.py)

Writes OUT/results.csv (kernel, provider, shape, dtype, tokens, metric, median, p20, p80, device, versions, and
the machine: cpu_model, cpu_flags, isa_limits, cpu_cores, threads, torch, transformers) and
OUT/<kernel>_<shape>_<dtype>.png (latency vs tokens, one line per provider, p20-p80 band), then prints the
ratios. Ratios are the figures to read: providers take turns within each run, so a busy machine slows all alike.
In the CSV, the attention suite's "fused" provider is called "layerswap" and its per-round fused/stock ratio is
metric "ratio_vs_stock"; a roofline is provider "roofline", metric "latency_ms" (the machine's floor).
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
sys.path.insert(0, str(HERE))
try:
    import layerswap
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT / "src"))
    import layerswap

import torch  # noqa: E402

from machine import MACHINE_FIELDS, RESULT_FIELDS, machine_fields, machine_label  # noqa: E402

SUITES = ("moe", "attention", "memory", "load", "model")
CSV_FIELDS = (*RESULT_FIELDS, "versions", *MACHINE_FIELDS)
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def versions() -> str:
    parts = [f"layerswap {layerswap.__version__}", f"torch {torch.__version__}"]
    for name in ("transformers", "bitsandbytes", "triton"):
        try:
            module = __import__(name)
            parts.append(f"{name} {module.__version__}")
        except Exception:  # absent or broken: the versions column says so
            parts.append(f"{name} -")
    return "; ".join(parts)


def _row(kernel, provider, shape, dtype, tokens, metric, median, p20, p80, device) -> dict:
    return dict(
        kernel=kernel,
        provider=provider,
        shape=shape,
        dtype=str(dtype).removeprefix("torch."),
        tokens=tokens,
        metric=metric,
        median=float(median),
        p20=float(p20),
        p80=float(p80),
        device=device,
    )


# --- suites --------------------------------------------------------------------------------------------------


def run_moe(device: torch.device, quick: bool) -> list[dict]:
    import bench_fused_moe as moe

    tokens = [1, 16, 128] if quick else [1, 16, 128, 512]
    if device.type == "cuda":
        tokens = [1, 16, 512, 4096] if quick else [1, 16, 128, 512, 4096]
    dtypes = [torch.bfloat16] if device.type == "cuda" else [torch.float32, torch.bfloat16]
    reps, budget = (5, 1.0) if quick else (12, 4.0)
    if device.type == "cuda":
        reps, budget = (30, 1.0) if quick else (100, 3.0)
    gather_limit = 40.0 if device.type == "cuda" else 2.0
    raw = moe.sweep(
        shapes=moe.load_shapes(list(moe.SHAPES)),
        dtypes=dtypes,
        tokens=tokens,
        providers=list(moe.PROVIDERS),
        device=device,
        reps=reps,
        budget_s=budget,
        gather_limit_gib=gather_limit,
        flush_mib=512,
    )
    rows = []
    for r in raw:
        metric = "latency_ms" if r["metric"] == "ms" else r["metric"]  # the roofline row
        rows.append(
            _row(
                r["kernel"],
                r["provider"],
                r["shape"],
                r["dtype"],
                r["T"],
                metric,
                r["median"],
                r["p20"],
                r["p80"],
                r["device"],
            )
        )
    return rows


def run_attention(device: torch.device, quick: bool) -> list[dict]:
    import bench_attention as attention

    tokens = (1, 16, 128) if quick else attention.TOKENS
    repeats, working_set_mb = (7, 256.0) if quick else (30, 1024.0)
    dtypes = tuple(attention.DTYPES)
    points = attention.sweep(
        shapes=tuple(attention.SHAPES),
        dtypes=dtypes,
        tokens=tuple(tokens),
        repeats=repeats,
        working_set_mb=working_set_mb,
        device=str(device),
    )
    total = len(attention.SHAPES) * len(dtypes) * len(tokens) * 7  # rows per point, as bench_attention counts
    rows = []
    for r in _progress(points, total=total, desc="attention sweep"):
        provider, metric = r["provider"], "latency_ms" if r["metric"] == "ms" else r["metric"]
        if provider == "fused":
            provider = "layerswap"
        elif provider == "fused/stock":
            provider, metric = "layerswap", "ratio_vs_stock"
        dtype = _DTYPE_NAMES.get(r["dtype"], r["dtype"])  # the names the moe suite uses
        rows.append(
            _row(
                r["kernel"],
                provider,
                r["shape"],
                dtype,
                r["T"],
                metric,
                r["median"],
                r["p20"],
                r["p80"],
                r["device"],
            )
        )
    return rows


def run_memory(device: torch.device, quick: bool) -> list[dict]:
    import memory

    rows = memory.sweep()
    memory.print_table(rows)
    return [
        _row(
            r["kernel"],
            r["provider"],
            r["shape"],
            r["dtype"],
            r["tokens"],
            r["metric"],
            *r["stats"],
            "meta (exact count)",
        )
        for r in rows
    ]


def run_load(device: torch.device, quick: bool) -> list[dict]:
    import load

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = load.sweep(
        load.CheckpointShape(),
        schemes=("bf16", "nf4"),
        loads=1 if quick else 3,
        device=str(device),
        layouts=load.LAYOUTS,
    )
    load.print_table(rows)
    return [
        _row(r["kernel"], r["provider"], r["shape"], r["dtype"], r["tokens"], r["metric"], *r["stats"], where)
        for r in rows
    ]


def run_model(device: torch.device, quick: bool) -> list[dict]:
    import bench_model

    if device.type != "cpu":
        print("# suite model: CPU only for now; skipped", file=sys.stderr)
        return []
    rows = bench_model.sweep(bench_model.Settings.quick() if quick else bench_model.Settings())
    bench_model.print_table(rows)
    return [
        _row(
            r["kernel"],
            r["provider"],
            r["shape"],
            r["dtype"],
            r["tokens"],
            r["metric"],
            r["median"],
            r["p20"],
            r["p80"],
            r["device"],
        )
        for r in rows
    ]


SUITE_RUNNERS: dict[str, Callable[[torch.device, bool], list[dict]]] = {
    "moe": run_moe,
    "attention": run_attention,
    "memory": run_memory,
    "load": run_load,
    "model": run_model,
}


def _progress(iterable, **kwargs):
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra brings tqdm
        return iterable
    return tqdm(iterable, file=sys.stderr, **kwargs)


# --- output --------------------------------------------------------------------------------------------------


def write_csv(rows: Sequence[dict], path: Path, versions_text: str) -> None:
    machine = machine_fields()
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in rows:
            writer.writerow(
                {
                    **r,
                    **{k: f"{r[k]:.6g}" for k in ("median", "p20", "p80")},
                    "versions": versions_text,
                    **machine,
                }
            )


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()


def plot(rows: Sequence[dict], out: Path) -> list[Path]:
    """One PNG per (kernel, shape, dtype): median latency vs tokens per provider, p20-p80 shaded."""
    try:
        import matplotlib
    except ImportError:
        print("# no plots: matplotlib is not installed (pip install 'layerswap[bench]')", file=sys.stderr)
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[tuple[str, str, str], dict[str, list[tuple[int, float, float, float]]]] = {}
    for r in rows:
        if r["metric"] != "latency_ms" or not str(r["tokens"]).isdigit():
            continue
        key = (r["kernel"], r["shape"], r["dtype"])
        curves.setdefault(key, {}).setdefault(r["provider"], []).append(
            (int(r["tokens"]), r["median"], r["p20"], r["p80"])
        )
    written = []
    for (kernel, shape, dtype), by_provider in curves.items():
        figure, axes = plt.subplots(figsize=(6.4, 4.2))
        for provider, points in sorted(by_provider.items(), key=lambda kv: (kv[0] == "roofline", kv[0])):
            points.sort()
            x = [p[0] for p in points]
            style = {"linestyle": "--", "color": "grey"} if provider == "roofline" else {"marker": "o"}
            (line,) = axes.plot(x, [p[1] for p in points], label=provider, **style)
            if provider != "roofline":
                axes.fill_between(
                    x, [p[2] for p in points], [p[3] for p in points], alpha=0.2, color=line.get_color()
                )
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("tokens")
        axes.set_ylabel("latency (ms, median; band p20-p80)")
        device = next(
            r["device"] for r in rows if (r["kernel"], r["shape"], r["dtype"]) == (kernel, shape, dtype)
        )
        axes.set_title(f"{kernel}: {shape}, {dtype}\n{device}; {machine_label()}", fontsize=7)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        path = out / f"{_slug(kernel)}_{_slug(shape)}_{_slug(dtype)}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    memory_rows = [r for r in rows if r["kernel"] == "weight_footprint"]
    if memory_rows:
        written.append(_plot_memory(memory_rows, out, plt))
    return written


def _plot_memory(rows: Sequence[dict], out: Path, plt) -> Path:
    models = list(dict.fromkeys(r["shape"] for r in rows))
    bars = [("stock", "bf16"), ("stock", "nf4"), ("bundle", "nf4"), ("stock", "int8"), ("bundle", "int8")]
    values = {
        (r["shape"], "stock" if r["provider"] == "stock" else "bundle", r["dtype"]): r["median"] for r in rows
    }
    figure, axes = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(bars)
    for i, (provider, scheme) in enumerate(bars):
        heights = [values.get((m, provider, scheme), math.nan) for m in models]
        label = f"{scheme} stock" if provider == "stock" else f"{scheme} with -quant"
        axes.bar([j + i * width for j in range(len(models))], heights, width, label=label)
    axes.set_xticks(
        [j + 0.4 - width / 2 for j in range(len(models))], [m.split("/")[-1] for m in models], fontsize=8
    )
    axes.set_ylabel("weight footprint (GiB)")
    axes.set_title(
        "bitsandbytes weight footprint, stock vs <model_type>-quant (exact, meta device)\n" + machine_label(),
        fontsize=8,
    )
    axes.legend(fontsize=8)
    figure.tight_layout()
    path = out / "weight_footprint.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def print_ratios(rows: Sequence[dict]) -> None:
    """The headline figures: layerswap's latency as a ratio to stock (below 1 is faster)."""
    moe = [
        r
        for r in rows
        if r["kernel"] == "moe_experts"
        and r["metric"] == "ratio_vs_best_stock"
        and r["provider"] == "layerswap"
    ]
    if moe:
        print("# moe_experts: layerswap / best stock backend, median [p20, p80]")
        for r in moe:
            print(
                f"  {r['shape']:18} {r['dtype']:9} T={r['tokens']:>5}  {r['median']:.3f} [{r['p20']:.3f}, {r['p80']:.3f}]"
            )
    attention = [r for r in rows if r["metric"] == "ratio_vs_stock"]
    if attention:
        print("# attention: fused_qkv (layerswap) / stock, median [p20, p80] of per-round ratios")
        for r in attention:
            print(
                f"  {r['kernel']:10} {r['shape'].split('/')[-1]:14} {r['dtype']:9} T={r['tokens']:>4}  "
                f"{r['median']:.3f} [{r['p20']:.3f}, {r['p80']:.3f}]"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks/run.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--suite", choices=[*SUITES, "all"], default="all")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--out", type=Path, default=Path("bench-out"), help="output directory (default bench-out/)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer token counts and repetitions (minutes)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `layerswap bench -- --suite moe` passes the separator on
        argv = argv[1:]
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"benchmarks/run.py: no CUDA device is present (torch {torch.__version__}: "
            "torch.cuda.is_available() is False), so nothing was run. Use --device cpu, or run on a GPU machine.",
            file=sys.stderr,
        )
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    suites = SUITES if args.suite == "all" else (args.suite,)
    args.out.mkdir(parents=True, exist_ok=True)
    versions_text = versions()
    print(
        f"# {versions_text}; device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} "
        f"({torch.get_num_threads()} threads); suites {', '.join(suites)}{'; quick' if args.quick else ''}"
    )
    print(f"# {machine_label()}")
    rows: list[dict] = []
    for suite in suites:
        print(f"# suite {suite}", file=sys.stderr)
        rows += SUITE_RUNNERS[suite](device, args.quick)
        write_csv(
            rows, args.out / "results.csv", versions_text
        )  # after each suite: a late failure keeps the rest
    plots = plot(rows, args.out)
    print_ratios(rows)
    print(f"# wrote {args.out / 'results.csv'} ({len(rows)} rows) and {len(plots)} plots in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
