"""weight_footprint (computed on the meta device) against get_memory_footprint() of models loaded for real with
bitsandbytes on CPU, and the -quant bundle's load memory on a small checkpoint."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import layerswap
from _support.tiny_models import tiny_config
from layerswap import BundleError
from layerswap.memory import bnb_replaced_linears, weight_footprint
from layerswap.shapes import meta_model, resolve_config
from layerswap.testing import load_probe

QUANTIZATION = {
    "nf4": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    "int8": {"load_in_8bit": True},
}


def _saved(tmp_path_factory, model_type, **overrides):
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp(model_type)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(directory)
    return config, directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Scaled-down models of the benchmarked families (2 layers, hidden 64): config and bf16 checkpoint."""
    saved = {t: _saved(tmp_path_factory, t) for t in ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")}
    # Llama-3.2-1B ties lm_head to the embeddings: the tied weight counts once and stays unquantized.
    saved["llama"] = _saved(tmp_path_factory, "llama", tie_word_embeddings=True)
    return saved


def _loaded_footprint(directory, scheme):
    quantization = (
        {"quantization_config": BitsAndBytesConfig(**QUANTIZATION[scheme])} if scheme != "bf16" else {}
    )
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, **quantization)
    return model.get_memory_footprint()


CASES = [
    # With the bundle, for each family and scheme: the case the memory table exists for.
    *[(t, s, True) for t in ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe") for s in ("nf4", "int8")],
    # Stock: the 3D experts stay in bf16 (qwen2_moe also has a quantizable shared expert).
    ("qwen2_moe", "nf4", False),
    ("mixtral", "int8", False),
    ("llama", "nf4", False),
    ("qwen2_moe", "bf16", True),
]


@pytest.mark.parametrize(("model_type", "scheme", "with_bundle"), CASES)
def test_footprint_on_meta_matches_get_memory_footprint_of_a_real_load(
    checkpoints, model_type, scheme, with_bundle
):
    config, directory = checkpoints[model_type]
    bundles = (f"{model_type}-quant",) if with_bundle else ()
    with layerswap.use_bundle(*bundles):
        real = _loaded_footprint(directory, scheme)
        computed = weight_footprint(meta_model(config), scheme).total_bytes
    # The brief's bar is 2%; the count replays the quantizer exactly, so it is in fact byte-exact.
    assert abs(computed - real) <= 0.02 * real, f"computed {computed:,} B, loaded model {real:,} B"
    assert computed == real


def test_bundle_quantizes_the_experts_and_keeps_routers_lm_head_and_one_wide_gates():
    config = resolve_config("Qwen/Qwen1.5-MoE-A2.7B")
    stock = bnb_replaced_linears(meta_model(config))
    with layerswap.use_bundle("qwen2_moe-quant"):
        model = meta_model(config)
        replaced = bnb_replaced_linears(model)
        nf4 = weight_footprint(model, "nf4")
        bf16 = weight_footprint(model, "bf16")
    assert not any(".experts." in name for name in stock)
    assert "model.layers.0.mlp.experts.59.down_proj" in replaced
    assert not any(name.endswith(("mlp.gate", "shared_expert_gate", "lm_head")) for name in replaced)
    assert bf16.quantized_params == 0 and bf16.total_bytes == 2 * bf16.kept_params + bf16.buffer_bytes
    # 24 layers x (60 experts x 3 + shared expert 3 + attention 4) linears.
    assert nf4.quantized_modules == len(replaced) == 24 * (60 * 3 + 3 + 4)
    assert nf4.total_gib < 0.3 * bf16.total_gib


def test_unknown_scheme_is_an_error_that_names_the_choices():
    model = meta_model(tiny_config("qwen2_moe"))
    with pytest.raises(BundleError, match="nf4, int8"):
        weight_footprint(model, "fp4x")


# --- load memory ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="reads peak RSS from Linux's /proc/self/status"
)
@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_bundle_load_does_not_hold_the_experts_twice(tmp_path, layout):
    """The load's own peak RSS (each load in a fresh process, peak reset after the imports) with the bundle stays
    within 1.1x stock's, and the weights' storages add up to stock's. Per-expert checkpoints: stock stacks the
    tensors into 3D copies while the checkpoint's pages are mapped, so it peaks near twice the checkpoint; a bundle
    that stacked and then split would peak higher still. Fused checkpoints: stock keeps zero-copy views of the
    mapped file; the bundle's split must be views too, not a copy per expert."""
    shape = load_probe.CheckpointShape(hidden=512, moe_intermediate=256, experts=32, layers=2, vocab=512)
    size_mib = load_probe.make_checkpoint(shape, tmp_path, layout) / 2**20
    stock, bundle = load_probe.load_concurrently(
        [(tmp_path, "", "bf16"), (tmp_path, "qwen2_moe-quant", "bf16")]
    )
    assert bundle["footprint_mib"] == pytest.approx(stock["footprint_mib"])
    assert bundle["held_storage_mib"] == pytest.approx(stock["held_storage_mib"])
    assert bundle["load_peak_rss_mib"] <= 1.1 * stock["load_peak_rss_mib"], (stock, bundle)
    # Absolute form of the same property: one copy of the weights plus a little working memory.
    assert bundle["load_peak_rss_mib"] <= 1.5 * size_mib + 32, (size_mib, bundle)
