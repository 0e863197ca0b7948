"""The repository's own rules: benchmarks and tests depend on each other in one direction only."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imported_modules(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


def test_benchmarks_do_not_import_tests_and_tests_do_not_import_benchmarks():
    test_modules = {p.stem for p in (ROOT / "tests").glob("*.py")} | {
        p.name for p in (ROOT / "tests").iterdir() if p.is_dir()
    }
    benchmark_modules = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in (ROOT / "benchmarks").glob("*.py")
        for name in _imported_modules(path)
        if name in test_modules - benchmark_modules
    ]
    wrong += [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in (ROOT / "tests").rglob("*.py")
        for name in _imported_modules(path)
        if name in benchmark_modules | {"benchmarks"}
    ]
    assert not wrong
