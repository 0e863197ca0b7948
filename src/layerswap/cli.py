"""`layerswap list | inspect | demo`.

Benchmarks are scripts of a source checkout, not part of the installed package: `python benchmarks/run.py`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _cmd_list(args: argparse.Namespace) -> int:
    from . import list_bundles
    from ._hf.compat import TRANSFORMERS_VERSION, bundle_requirement
    from .families import ALREADY_LINEAR, DERIVED, UNCOVERED, already_linear_reason, families_without_replay
    from .swaps.replay.modules import UNREPLAYABLE

    bundles = list_bundles()
    # Bundles the installed transformers is too old for (enable_bundle refuses them): what they need.
    needs = {b.name: need for b in bundles if (need := bundle_requirement(b)) is not None}
    if args.markdown:
        print("| bundle | purpose | model types | what it does |")
        print("| --- | --- | --- | --- |")
        for b in bundles:
            note = f" Needs {needs[b.name]}." if b.name in needs else ""
            print(f"| `{b.name}` | {b.purpose} | {', '.join(b.model_types)} | {b.description}{note} |")
        print(f"\nRows derived from transformers {TRANSFORMERS_VERSION} (no hand-written row): ", end="")
        print(", ".join(f"`{f.model_type}`" for f in DERIVED) + ".")
        print("\nWithout a '-replay' bundle (no scorer mirrors the router's weights yet): ", end="")
        without = sorted(families_without_replay().items())
        print(
            ", ".join(
                f"`{t}` ({router or 'no router class found'}"
                + (f": it {UNREPLAYABLE[router]}" if router in UNREPLAYABLE else "")
                + ")"
                for t, router in without
            )
            + "."
        )
        print(f"\n## MoE families of transformers {TRANSFORMERS_VERSION} without bundles\n")
        print("| model type | why |")
        print("| --- | --- |")
        for model_type, reason in sorted(UNCOVERED.items()):
            print(f"| {model_type} | {reason} |")
        print(f"\n## MoE families of transformers {TRANSFORMERS_VERSION} that need no bundle\n")
        print("| model type | why |")
        print("| --- | --- |")
        for model_type in sorted(ALREADY_LINEAR):
            print(f"| {model_type} | {already_linear_reason(model_type)} |")
        return 0
    width = max(len(b.name) for b in bundles)
    for b in bundles:
        note = f"  [needs {needs[b.name]}]" if b.name in needs else ""
        print(f"{b.name:<{width}}  {b.purpose:<10} {b.description.split('.')[0]}{note}")
    print(f"\n{len(bundles)} bundles. `layerswap list --markdown` prints the catalog for docs.")
    print(
        f"{len(UNCOVERED)} MoE families of transformers {TRANSFORMERS_VERSION} have no bundle, each for a reason, "
        f"and {len(ALREADY_LINEAR)} need none: their experts are already nn.Linear ({', '.join(sorted(ALREADY_LINEAR))}) "
        "(`layerswap list --markdown` lists them)."
    )
    if needs:
        print(
            f"{len(needs)} of them need a newer transformers than the installed {TRANSFORMERS_VERSION} "
            "(marked [needs ...]); enable_bundle refuses them."
        )
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from . import report, use_bundle
    from .catalog import CATALOG
    from .families import ALREADY_LINEAR, UNCOVERED, already_linear_reason
    from .shapes import meta_model, resolve_config

    config = resolve_config(args.config)
    bundles = args.bundle or [
        n for n, b in CATALOG.items() if b.purpose == "quant" and config.model_type in b.model_types
    ]
    stock = report(meta_model(config))
    with use_bundle(*bundles):
        swapped = report(meta_model(config))
    print(f"model type {config.model_type}; bundles: {', '.join(bundles) or 'none for this model type'}")
    if not bundles and config.model_type in ALREADY_LINEAR:
        print(f"  {already_linear_reason(config.model_type)}")
    elif not bundles and config.model_type in UNCOVERED:
        print(f"  not served: {UNCOVERED[config.model_type]}")
    print()
    print(f"{'':28}{'stock':>16}{'with bundles':>16}")
    rows = [
        ("parameters", stock.total_params, swapped.total_params),
        ("in quantizable nn.Linear", stock.linear_params, swapped.linear_params),
        ("expert params in nn.Linear", stock.expert_linear_params, swapped.expert_linear_params),
    ]
    for label, a, b in rows:
        print(f"{label:<28}{a:>16,}{b:>16,}")
    print(f"{'quantizable share':<28}{stock.linear_share:>16.1%}{swapped.linear_share:>16.1%}")
    print("\nswapped: " + (", ".join(f"{k} x{v}" for k, v in sorted(swapped.swapped.items())) or "nothing"))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(model_type=args.model_type)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="layerswap", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="the bundle catalog")
    listing.add_argument("--markdown", action="store_true", help="as a Markdown table")
    listing.set_defaults(run=_cmd_list)
    inspect = commands.add_parser(
        "inspect", help="what bundles would swap in a model, built on the meta device"
    )
    inspect.add_argument(
        "config", help="a config.json, a directory with one, or a model name in model_shapes.json"
    )
    inspect.add_argument(
        "--bundle", action="append", help="bundle to apply (default: the model type's -quant)"
    )
    inspect.set_defaults(run=_cmd_inspect)
    demo = commands.add_parser("demo", help="tiny end-to-end demo: stock vs -quant under bitsandbytes 4-bit")
    demo.add_argument("--model-type", default="qwen2_moe")
    demo.set_defaults(run=_cmd_demo)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return args.run(args)
    except Exception as error:
        from .errors import BundleError

        if isinstance(error, BundleError):
            print(f"layerswap: {error}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    raise SystemExit(main())
