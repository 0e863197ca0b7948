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


def test_every_integration_suite_has_pins_tests_and_is_documented():
    # integration/run.sh runs every folder of integration/ with a requirements.txt, in a venv of its own; the
    # main suite cannot run them (other pins), so it checks that none is left without pins or tests, or unsaid.
    suites = sorted(p.parent for p in (ROOT / "integration").glob("*/requirements.txt"))
    assert suites, "integration/ has no suite"
    for suite in suites:
        assert list(suite.glob("test_*.py")), f"{suite.relative_to(ROOT)} has pins but no test_*.py"
        pins = [line.split("#")[0].strip() for line in (suite / "requirements.txt").read_text().splitlines()]
        unpinned = [pin for pin in pins if pin and "==" not in pin]
        assert not unpinned, f"{suite.relative_to(ROOT)}/requirements.txt: not pinned exactly: {unpinned}"
    folders = {
        p.name for p in (ROOT / "integration").iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
    }
    assert folders == {suite.name for suite in suites}, "a folder of integration/ without requirements.txt"
    readme = (ROOT / "README.md").read_text()
    assert "bash integration/run.sh" in readme
    for suite in suites:
        assert f"integration/{suite.name}" in readme, f"README.md does not mention integration/{suite.name}"
