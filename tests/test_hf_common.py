"""transformers' own common model tests (tools/hf_common_tests.py) on one family, stock and inside apply_bundles()
for '-quant' and '-fast': every outcome that differs from stock is one docs/troubleshooting.md's table explains.
The full run (four families, every purpose, both modes) is `python tools/hf_common_tests.py`, about 15 minutes."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest
import transformers

_TOOL = Path(__file__).resolve().parent.parent / "tools" / "hf_common_tests.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("hf_common_tests", _TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def runs(tool):
    package = tool.sources(transformers.__version__)
    workdir = Path(tempfile.mkdtemp(prefix="layerswap-hf-common-"))
    stock = tool.run("qwen2_moe", None, "plain", package, workdir)
    bundled = {
        p: tool.run("qwen2_moe", f"qwen2_moe-{p}", "construct", package, workdir) for p in ("quant", "fast")
    }
    return stock, bundled


def test_stock_runs_the_common_tests(runs):
    stock, _ = runs
    passed = [t for t, outcome in stock.items() if outcome == "passed"]
    assert len(passed) >= 100, stock  # 114 on transformers 5.24


@pytest.mark.parametrize("purpose", ["quant", "fast"])
def test_every_difference_from_stock_is_documented(tool, runs, purpose):
    stock, bundled = runs
    outcomes = bundled[purpose]
    assert outcomes.keys() == stock.keys()
    differs = {t: o for t, o in outcomes.items() if o != stock[t]}
    assert tool.undocumented("qwen2_moe", purpose, differs) == {}
    if purpose == "quant":  # the table's rows for '-quant' on qwen2_moe are what the run finds
        assert any(t.startswith("test_eager_matches_batched_and_grouped_inference") for t in differs)


def test_the_docs_table_is_parsed(tool):
    explained = tool.documented()
    assert ("test_reverse_loading_mapping", "quant", "mixtral") in explained
    assert ("test_model_weights_reload_no_missing_tied_weights", "fast", "olmoe") in explained
    assert ("test_eager_matches_batched_and_grouped_inference", "replay", "qwen2_moe") not in explained
    # A difference no row explains is reported, parameterized cases of a documented test are not.
    assert tool.undocumented("qwen2_moe", "quant", {"test_new_failure": "failed"}) == {
        "test_new_failure": "failed"
    }
    assert tool.undocumented("qwen2_moe", "quant", {"test_reverse_loading_mapping_1": "failed"}) == {}
