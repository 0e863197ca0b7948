"""Import a script of benchmarks/ (not a package) from the tests."""

import importlib.util
import sys
from pathlib import Path


def benchmark_module(name):
    """benchmarks/<name>.py, imported under a private name (benchmarks/ is not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_layerswap_benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module
