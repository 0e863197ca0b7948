"""The docs' Python examples run as written: every ```python block of each page, in order, in one namespace per
page, with `path` (a tiny stock checkpoint of the family the page's examples name), `config`, `out` and the
transformers classes they use bound first."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import transformers

import layerswap
from _support.tiny_models import tiny_model

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/quickstart.md", "docs/benchmarks.md")
# Pages whose examples need a tool the main suite does not install: the integration suite named runs them.
RUN_BY_INTEGRATION = {"docs/vllm.md": "integration/vllm/test_vllm.py"}
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def _blocks(page: str) -> list[str]:
    return BLOCK.findall((ROOT / page).read_text())


def test_every_page_with_python_examples_is_run():
    with_examples = {
        str(path.relative_to(ROOT))
        for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        if _blocks(str(path.relative_to(ROOT)))
    }
    assert with_examples == set(PAGES) | set(RUN_BY_INTEGRATION)
    for page, test in RUN_BY_INTEGRATION.items():
        assert page in (ROOT / test).read_text(), f"{test} does not run {page}'s examples"


@pytest.mark.parametrize("page", PAGES)
def test_the_examples_run(page, tmp_path, capsys):
    blocks = _blocks(page)
    families = sorted(set(re.findall(r'"(\w+)-(?:quant|fast|fused_qkv|replay)"', "".join(blocks))))
    # Every family named, with `path` the first one's checkpoint (each page names one for its loads).
    checkpoints = {}
    for model_type in families:
        checkpoints[model_type] = tmp_path / model_type
        tiny_model(model_type).save_pretrained(checkpoints[model_type])
    namespace = {
        "layerswap": layerswap,
        "path": str(checkpoints[families[0]]) if families else None,
        "config": transformers.AutoConfig.from_pretrained(checkpoints[families[0]]) if families else None,
        "out": str(tmp_path / "saved"),
        "AutoModelForCausalLM": transformers.AutoModelForCausalLM,
        "BitsAndBytesConfig": transformers.BitsAndBytesConfig,
        "MixtralForCausalLM": transformers.MixtralForCausalLM,
    }
    try:
        for index, block in enumerate(blocks):
            exec(compile(block, f"{page} (python block {index + 1})", "exec"), namespace)
    finally:
        for name in reversed(layerswap.enabled_bundles()):  # a page may leave its bundles on, as a user would
            layerswap.disable_bundle(name)
    printed = capsys.readouterr().out
    if page == "README.md":
        assert re.search(r"quantized +[\d,]+ \(100\.0%\)", printed), printed
        # As the example says: the 4-bit save loads back, every expert quantized, under the bundle it records, and
        # a load without the bundle raises.
        assert layerswap.report(namespace["model"]).expert_quantized_share == 1.0
        assert layerswap.recorded_bundles(namespace["out"]) == {"qwen2_moe-quant": {}}
        with pytest.raises(layerswap.CheckpointNeedsBundleError, match="qwen2_moe-quant"):
            transformers.AutoModelForCausalLM.from_pretrained(namespace["out"])
    if page == "docs/benchmarks.md":
        assert "15.1" in printed
