"""The -fast bundles for every MoE family: stock outputs, stock checkpoints both ways, composition rules."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import layerswap
from _support.checkpoints import assert_state_dicts_identical
from _support.families import FAST_FAMILIES, MOE_FAMILIES
from _support.tiny_models import auto_class, text_logits, tiny_input_ids, tiny_model
from layerswap.errors import BundleConflictError
from layerswap.swaps.fast.modules import FusedExpertsForwardMixin
from layerswap.swaps.fused_qkv.modules import FusedQKVAttention


@pytest.mark.parametrize("family", FAST_FAMILIES, ids=lambda f: f.model_type)
def test_fast_bundle_matches_stock_and_saves_stock_checkpoints(family, tmp_path):
    stock = tiny_model(family.model_type)
    stock.save_pretrained(tmp_path / "stock")
    with torch.no_grad():
        expected = text_logits(stock, tiny_input_ids())
    with layerswap.use_bundle(f"{family.model_type}-fast"):
        model, info = auto_class(family.model_type).from_pretrained(
            tmp_path / "stock", output_loading_info=True, attn_implementation="eager"
        )
        model.save_pretrained(tmp_path / "saved")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert any(isinstance(m, FusedExpertsForwardMixin) for m in model.modules())
    if family.attention is not None:
        assert any(isinstance(m, FusedQKVAttention) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(text_logits(model, tiny_input_ids()), expected, atol=1e-5, rtol=1e-5)
    reloaded, info = auto_class(family.model_type).from_pretrained(
        tmp_path / "saved", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert_state_dicts_identical(stock, reloaded)


def test_fast_and_quant_replace_the_experts_differently_and_conflict():
    layerswap.enable_bundle("qwen2_moe-quant")
    with pytest.raises(BundleConflictError, match="Qwen2MoeExperts"):
        layerswap.enable_bundle("qwen2_moe-fast")
    layerswap.disable_bundle("qwen2_moe-quant")


def test_fast_composes_with_fused_qkv(tmp_path):
    stock = tiny_model("qwen3_moe")
    stock.save_pretrained(tmp_path / "stock")
    with layerswap.use_bundle("qwen3_moe-fused_qkv", "qwen3_moe-fast"):
        model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "stock", output_loading_info=True)
        model.save_pretrained(tmp_path / "saved")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(
            text_logits(model, tiny_input_ids()), text_logits(stock, tiny_input_ids()), atol=1e-5, rtol=1e-5
        )
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert_state_dicts_identical(stock, reloaded)


def test_families_that_compute_their_own_gate_get_no_fast_bundle():
    # deepseek_v4, hy_v4 and beam clamp (or upcast) their SwiGLU in their own _apply_gate; the fused kernels compute
    # act(gate) * up only, so offering '-fast' for them would offer wrong outputs.
    own_gate = [f for f in MOE_FAMILIES if f.own_gate]
    assert {"deepseek_v4", "hy_v4", "beam"} <= {f.model_type for f in own_gate}
    names = {b.name for b in layerswap.list_bundles()}
    for family in own_gate:
        assert f"{family.model_type}-fast" not in names
        assert f"{family.model_type}-quant" in names
