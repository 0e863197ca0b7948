"""Weight footprint of the published models under bitsandbytes nf4 / int8, stock vs the `-quant` bundle.

    python benchmarks/memory.py                      # every model in model_shapes.json, a table in GiB
    python benchmarks/memory.py --models Qwen/Qwen3-30B-A3B

Exact, not estimated: each model is built on the meta device (no weights, no downloads) and
`layerswap.memory.weight_footprint` replays which linear layers transformers' bitsandbytes quantizer would
replace, counting bytes as `get_memory_footprint()` does on the loaded model (tests/test_memory.py checks the
two agree on scaled-down models of each family, loaded for real). bf16 is the unquantized baseline.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
try:
    import layerswap
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT / "src"))
    import layerswap

from layerswap.catalog import CATALOG  # noqa: E402
from layerswap.memory import SCHEMES, weight_footprint  # noqa: E402
from layerswap.shapes import load_model_shapes, meta_model, resolve_config  # noqa: E402


def quant_bundle(model_type: str) -> str | None:
    name = f"{model_type}-quant"
    return name if name in CATALOG else None


def footprints(model_name: str, schemes: Sequence[str] = SCHEMES) -> dict[str, dict[str, int]]:
    """{"stock" | "<model_type>-quant": {scheme: bytes}} for one model of model_shapes.json."""
    config = resolve_config(model_name)
    bundle = quant_bundle(config.model_type)
    out = {}
    for provider, bundles in (("stock", ()), *(((bundle, (bundle,)),) if bundle else ())):
        with layerswap.use_bundle(*bundles):
            model = meta_model(config)
            out[provider] = {scheme: weight_footprint(model, scheme).total_bytes for scheme in schemes}
        del model
    return out


def sweep(models: Sequence[str] | None = None, progress: bool = True) -> list[dict]:
    """Rows (kernel weight_footprint, provider stock / bundle, shape = model, dtype = scheme, metric GiB)."""
    try:
        from tqdm import tqdm
    except ImportError:

        def tqdm(iterable, **_):
            return iterable

    rows = []
    for model_name in tqdm(
        list(models or load_model_shapes()), desc="memory table", file=sys.stderr, disable=not progress
    ):
        for provider, by_scheme in footprints(model_name).items():
            for scheme, size in by_scheme.items():
                gib = size / 2**30
                rows.append(
                    dict(
                        kernel="weight_footprint",
                        provider=provider,
                        shape=model_name,
                        dtype=scheme,
                        tokens="-",
                        metric="GiB",
                        stats=(gib, gib, gib),
                    )
                )
    return rows


def print_table(rows: Sequence[dict]) -> None:
    table: dict[str, dict[tuple[str, str], float]] = {}
    for r in rows:
        provider = "stock" if r["provider"] == "stock" else "bundle"
        table.setdefault(r["shape"], {})[(provider, r["dtype"])] = r["stats"][0]
    print("# weight footprint in GiB (as get_memory_footprint() counts it); bundle = <model_type>-quant")
    header = f"{'model':30} {'bf16':>7} | {'nf4 stock':>9} {'nf4 bundle':>10} | {'int8 stock':>10} {'int8 bundle':>11}"
    print(header)

    def cell(by: dict, key: tuple[str, str], width: int) -> str:
        return f"{by[key]:>{width}.2f}" if key in by else f"{'n/a':>{width}}"

    for model, by in table.items():
        print(
            f"{model:30} {cell(by, ('stock', 'bf16'), 7)} | {cell(by, ('stock', 'nf4'), 9)} "
            f"{cell(by, ('bundle', 'nf4'), 10)} | {cell(by, ('stock', 'int8'), 10)} {cell(by, ('bundle', 'int8'), 11)}"
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=None, help="names in model_shapes.json (default: all)")
    args = parser.parse_args(argv)
    print_table(sweep(args.models))


if __name__ == "__main__":
    main()
