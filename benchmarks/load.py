"""from_pretrained wall time and peak RSS, stock vs the `-quant` bundle, each load in a fresh subprocess.

    python benchmarks/load.py                      # ~325 MiB bf16 qwen2_moe, per-expert and fused, bf16 + nf4, 3 loads
    python benchmarks/load.py --schemes bf16 --layouts per-expert --loads 1

Checkpoints (random weights, never downloaded) are made on the fly in a temporary directory, in the per-expert
layout stock `save_pretrained` writes (and the published checkpoints use) and in the fused 3D layout. Each load
runs alone in a new Python process; the child resets its peak RSS after its imports (VmHWM via clear_refs: the
`ru_maxrss` of getrusage, RUSAGE_CHILDREN included, survives execve and would report the parent's peak) and
reports, above its RSS just before `from_pretrained`:
  load_peak_rss_mib    peak RSS while loading and then reading every weight once (zero-copy weights are views of
                       the mmapped checkpoint and become resident only when read, as in a first forward pass);
  resident_after_mib   RSS after that; anon_after_mib its part that is not checkpoint pages (memory the process
                       owns; the kernel can drop clean file pages);
plus wall_s of `from_pretrained`, `get_memory_footprint()`, and held_storage_mib, the bytes of the distinct
storages behind the weights (a bundle that split a fused checkpoint into copies would hold them twice).
A bundle that held the experts twice would show about twice stock's anonymous memory. (Quantizing on CPU leaves a
freed transient per weight, which glibc keeps on the heap unless trimmed; layerswap trims it while loading, see
docs/troubleshooting.md, so a peak far above the median points at that.) Stock and bundle loads alternate, so a
busy machine slows both alike: read the ratios (metric `<name>_ratio`, provider `qwen2_moe-quant/stock`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
try:
    import layerswap  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT / "src"))

from layerswap.testing.load_probe import (  # noqa: E402
    LAYOUTS,
    SCHEMES,
    CheckpointShape,
    load_once,
    make_checkpoint,
)


def _quantiles(values: Sequence[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return statistics.median(values), cuts[1], cuts[7]


def sweep(
    shape: CheckpointShape,
    schemes: Sequence[str],
    loads: int,
    device: str = "cpu",
    progress: bool = True,
    layouts: Sequence[str] = ("per-expert",),
) -> list[dict]:
    """Rows (kernel from_pretrained, provider stock / qwen2_moe-quant / quant/stock, one metric each)."""
    try:
        from tqdm import tqdm
    except ImportError:

        def tqdm(iterable, **_):
            return iterable

    bundle = "qwen2_moe-quant"
    rows = []
    for layout in layouts:
        with tempfile.TemporaryDirectory(prefix="layerswap-load-") as tmp:
            directory = Path(tmp)
            size = make_checkpoint(shape, directory, layout)
            label = f"{shape.label} {layout} ({size / 2**20:.0f} MiB)"
            jobs = [
                (scheme, provider) for scheme in schemes for _ in range(loads) for provider in ("", bundle)
            ]
            results: dict[tuple[str, str], list[dict]] = {}
            for scheme, provider in tqdm(
                jobs, desc=f"from_pretrained loads, {layout}", file=sys.stderr, disable=not progress
            ):
                results.setdefault((scheme, provider), []).append(
                    load_once(directory, provider, scheme, device)
                )
            rows += _rows(label, schemes, results, bundle)
    return rows


def _rows(label: str, schemes: Sequence[str], results: dict, bundle: str) -> list[dict]:
    rows = []
    for scheme in schemes:
        stock, ours = results[(scheme, "")], results[(scheme, bundle)]
        for metric in stock[0]:
            for provider, samples in (("stock", stock), (bundle, ours)):
                rows.append(
                    dict(
                        kernel="from_pretrained",
                        provider=provider,
                        shape=label,
                        dtype=scheme,
                        tokens="-",
                        metric=metric,
                        stats=_quantiles([s[metric] for s in samples]),
                    )
                )
            ratios = [b[metric] / a[metric] for a, b in zip(stock, ours, strict=True) if a[metric] > 0]
            if ratios:
                rows.append(
                    dict(
                        kernel="from_pretrained",
                        provider=f"{bundle}/stock",
                        shape=label,
                        dtype=scheme,
                        tokens="-",
                        metric=f"{metric}_ratio",
                        stats=_quantiles(ratios),
                    )
                )
    return rows


def print_table(rows: Sequence[dict]) -> None:
    table: dict[tuple[str, str, str], dict[str, float]] = {}
    for r in rows:
        table.setdefault((r["shape"], r["dtype"], r["metric"]), {})[r["provider"]] = r["stats"][0]
    print("# from_pretrained, medians over fresh processes; bundle = qwen2_moe-quant")
    print(f"{'checkpoint':46} {'scheme':6} {'metric':18} {'stock':>9} {'bundle':>9} {'bundle/stock':>12}")
    for (shape, scheme, metric), by in table.items():
        if metric.endswith("_ratio"):
            continue
        ratio = table.get((shape, scheme, f"{metric}_ratio"), {}).get("qwen2_moe-quant/stock")
        print(
            f"{shape:46} {scheme:6} {metric:18} {by['stock']:>9.2f} {by['qwen2_moe-quant']:>9.2f} "
            f"{(f'{ratio:.3f}' if ratio is not None else '-'):>12}"
        )


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", nargs="+", default=["bf16", "nf4"], choices=SCHEMES)
    parser.add_argument("--loads", type=int, default=3, help="fresh-process loads per provider and scheme")
    parser.add_argument("--experts", type=int, default=CheckpointShape.experts)
    parser.add_argument("--hidden", type=int, default=CheckpointShape.hidden)
    parser.add_argument("--layers", type=int, default=CheckpointShape.layers)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    shape = CheckpointShape(hidden=args.hidden, experts=args.experts, layers=args.layers)
    print_table(sweep(shape, args.schemes, args.loads, args.device, layouts=args.layouts))


if __name__ == "__main__":
    main()
