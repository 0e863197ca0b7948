"""The package's structure, checked from its source: imports point only downward (no cycles, function-local
imports included), only `_hf/` touches transformers internals, and every purpose is one package under `swaps/`."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
import transformers

import layerswap
from layerswap.swaps import PURPOSES

SRC = Path(layerswap.__file__).resolve().parent

# Each layer may import only from the layers below it (and from itself). Modules not named here are the top
# (the public API, cli, demo, testing), which may import anything but must not be imported from below.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("layerswap.kernels",),
    ("layerswap.errors",),
    ("layerswap.bundle", "layerswap.quantized"),
    ("layerswap._hf",),
    ("layerswap.swaps",),
    ("layerswap.families",),
    ("layerswap.catalog",),
    ("layerswap.registry",),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in SRC.rglob("*.py")}


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The layerswap modules an import statement loads (a `from package import name` of a submodule counts as
    that submodule)."""
    modules = _modules()
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            package = ".".join([*base, *([node.module] if node.module else [])])
        else:
            package = node.module or ""
        targets = [
            f"{package}.{alias.name}" if f"{package}.{alias.name}" in modules else package
            for alias in node.names
        ]
    found = []
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target.startswith("layerswap") and target != module:
            found.append(target)
    return found


@cache
def import_graph() -> dict[str, frozenset[str]]:
    """module -> the layerswap modules it imports anywhere in its source (function bodies included)."""
    graph = {}
    for module, path in _modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        imports = (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
        graph[module] = frozenset(t for node in imports for t in _imported(module, path, node))
    return graph


def find_cycle(graph: dict[str, frozenset[str]]) -> list[str] | None:
    """One import cycle in `graph`, as the list of modules around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                return [*path[path.index(imported) :], imported]
            if imported not in state:
                cycle = visit(imported)
                if cycle:
                    return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(dict(import_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_function_local_cycle():
    # The check is only as good as the graph: a cycle through function-local imports must show.
    graph = dict(import_graph())
    assert "layerswap.bundle" in graph["layerswap.registry"]
    source = "def f():\n    from layerswap import registry\n"
    tree = ast.parse(source)
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    graph["layerswap.bundle"] = frozenset(_imported("layerswap.bundle", SRC / "bundle.py", node))
    assert find_cycle(graph) is not None


def _layer(module: str) -> int:
    for index, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return len(LAYERS)


@pytest.mark.parametrize("module", sorted(_modules()))
def test_imports_point_only_downward(module):
    upward = sorted(m for m in import_graph()[module] if _layer(m) > _layer(module))
    assert not upward, (
        f"{module} (layer {_layer(module)}) imports {upward} from above it; see docs/architecture.md"
    )


@cache
def _transformers_private_names() -> frozenset[str]:
    """Every `_name` transformers defines or reads as an attribute outside its per-model code."""
    root = Path(transformers.__file__).parent
    names: set[str] = set()
    for path in root.rglob("*.py"):
        if "models" not in path.relative_to(root).parts:
            names.update(
                re.findall(
                    r"(?:\bdef |\bclass |\.|\bimport |, )(_[A-Za-z]\w*)", path.read_text(errors="ignore")
                )
            )
    return frozenset(names)


def _private_names_used(tree: ast.AST) -> set[str]:
    """`_name`s that code reads or writes on objects it does not own: attributes, `getattr`-style string
    arguments, and names imported from transformers. (torch's own private API is not transformers'.)"""
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) not in ("torch", "F"):
            used.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
            used.update(alias.name for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and ast.unparse(node.args[0]) not in ("torch", "F")
        ):
            used.add(node.args[1].value)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            used.add(node.slice.value)
    return {
        name
        for name in used
        if isinstance(name, str) and name.startswith("_") and not name.startswith(("__", "_layerswap"))
    }


@pytest.mark.parametrize(
    "module", sorted(m for m in _modules() if not (m == "layerswap._hf" or m.startswith("layerswap._hf.")))
)
def test_only_hf_touches_transformers_private_names(module):
    tree = ast.parse(_modules()[module].read_text())
    found = sorted(_private_names_used(tree) & _transformers_private_names())
    assert not found, f"{module} touches transformers internals {found}: move that code into layerswap/_hf/"


def test_the_private_name_check_sees_an_internal():
    tree = ast.parse("x = model._tp_plan\ny = getattr(config, '_experts_implementation', None)\n")
    assert {"_tp_plan", "_experts_implementation"} <= _private_names_used(
        tree
    ) & _transformers_private_names()


def test_every_package_under_swaps_is_a_purpose_with_a_builder():
    packages = sorted(p.name for p in (SRC / "swaps").iterdir() if (p / "__init__.py").exists())
    assert sorted(PURPOSES) == packages
    purposes = {bundle.purpose for bundle in layerswap.list_bundles()}
    assert purposes == set(PURPOSES)
    for bundle in layerswap.list_bundles():
        assert bundle.name.endswith("-" + bundle.purpose)
