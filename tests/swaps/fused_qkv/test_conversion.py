"""q/k/v <-> qkv_proj checkpoint conversions of the '-fused_qkv' bundles.

Tiny random configs with GQA (4 heads, 2 kv heads: q is twice as wide as k and v, the case transformers'
equal-size Chunk gets wrong) and q/k/v biases wherever the family's config has a switch for them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, conversion_mapping
from transformers.core_model_loading import Concatenate, WeightConverter

import layerswap
from _support.checkpoints import checkpoint_factory, drop_keys, read_checkpoint
from _support.numerics import assert_computed_close
from _support.tiny_models import tiny_config, tiny_input_ids, tiny_model
from layerswap.catalog import CATALOG
from layerswap.errors import MissingExpertWeightsError
from layerswap.families import FAMILIES
from layerswap.swaps.fused_qkv.conversion import (
    ConcatenateQKV,
    FusedQKVConverter,
    SplitQKV,
    config_qkv_sizes,
    fused_qkv_conversions,
)
from layerswap.swaps.fused_qkv.modules import FusedQKVAttention

FUSED_TYPES = [f.model_type for f in FAMILIES if f"{f.model_type}-fused_qkv" in CATALOG]
BOTH_TYPES = [t for t in FUSED_TYPES if f"{t}-quant" in CATALOG]
_PROJECTION_KEYS = (".q_proj.", ".k_proj.", ".v_proj.")


def _overrides(model_type: str) -> dict:
    defaults = AutoConfig.for_model(model_type)
    return {switch: True for switch in ("attention_bias", "qkv_bias") if hasattr(defaults, switch)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_factory(tmp_path_factory, _overrides)


def _load_with(path: Path, *bundles: str, **kwargs):
    with layerswap.use_bundle(*bundles):
        return AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)


def _projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = (*_PROJECTION_KEYS, ".qkv_proj.")
    return {key: tensor for key, tensor in state.items() if any(name in key for name in names)}


def _assert_clean(info: dict) -> None:
    problems = {
        k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v
    }
    assert not problems, problems


@pytest.mark.parametrize("model_type", FUSED_TYPES)
def test_save_writes_the_stock_layout_that_stock_transformers_reloads(checkpoint, tmp_path, model_type):
    path = checkpoint(model_type)
    fused, info = _load_with(path, f"{model_type}-fused_qkv")
    _assert_clean(info)
    fused.save_pretrained(tmp_path)
    original, saved = read_checkpoint(path), read_checkpoint(tmp_path)
    assert set(saved) == set(original)
    assert any(any(p in key for p in _PROJECTION_KEYS) for key in original)
    different = [key for key in original if not torch.equal(saved[key], original[key])]
    assert not different, different[:6]
    # ... and stock transformers, with no bundle enabled, loads it cleanly.
    stock, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    _assert_clean(info)
    assert not any(isinstance(m, FusedQKVAttention) for m in stock.modules())


@pytest.mark.parametrize("model_type", FUSED_TYPES)
def test_a_fused_checkpoint_loads_and_saves_back_to_stock(checkpoint, tmp_path, model_type):
    path = checkpoint(model_type)
    fused, _ = _load_with(path, f"{model_type}-fused_qkv")
    fused.save_pretrained(tmp_path / "fused", save_original_format=False)
    written = read_checkpoint(tmp_path / "fused")
    assert any(".self_attn.qkv_proj." in key for key in written)
    assert not any(any(p in key for p in _PROJECTION_KEYS) for key in written)

    reloaded, info = _load_with(tmp_path / "fused", f"{model_type}-fused_qkv")
    _assert_clean(info)
    ids = tiny_input_ids()
    with torch.no_grad():
        assert_computed_close(reloaded(ids).logits, fused(ids).logits)
    # Loaded from a fused checkpoint, it still saves the stock q/k/v layout by default. (Weights that stock
    # transformers converts, such as fused experts or mimo's sinks, follow its rule: saved as they were loaded.)
    reloaded.save_pretrained(tmp_path / "stock")
    saved, original = _projections(read_checkpoint(tmp_path / "stock")), _projections(read_checkpoint(path))
    assert set(saved) == set(original)
    assert all(torch.equal(saved[key], original[key]) for key in original)


@pytest.mark.parametrize("quant_first", [False, True], ids=["fused_qkv-then-quant", "quant-then-fused_qkv"])
@pytest.mark.parametrize("model_type", BOTH_TYPES)
def test_composes_with_the_quant_bundle_in_either_order(checkpoint, tmp_path, model_type, quant_first):
    path = checkpoint(model_type)
    names = [f"{model_type}-fused_qkv", f"{model_type}-quant"][:: -1 if quant_first else 1]
    stock = AutoModelForCausalLM.from_pretrained(path).eval()
    both, info = _load_with(path, *names)
    _assert_clean(info)
    ids = tiny_input_ids()
    with torch.no_grad():
        torch.testing.assert_close(both.eval()(ids).logits, stock(ids).logits, atol=1e-5, rtol=1e-5)
    both.save_pretrained(tmp_path)
    saved, original = read_checkpoint(tmp_path), read_checkpoint(path)
    assert set(saved) == set(original)
    assert all(torch.equal(saved[key], original[key]) for key in original)


@pytest.mark.parametrize("model_type", BOTH_TYPES)
def test_conversion_edit_keeps_every_other_stock_transform(model_type):
    stock = conversion_mapping.get_checkpoint_conversion_mapping(model_type) or []
    edited = fused_qkv_conversions(stock, options=None)
    assert edited[: len(stock)] == stock
    assert [type(t) for t in edited[len(stock) :]] == [FusedQKVConverter, FusedQKVConverter]
    # Applying it again (as a later re-sync does to an already edited list) adds nothing.
    assert len(fused_qkv_conversions(edited, options=None)) == len(edited)


def test_from_config_model_saves_the_stock_layout(tmp_path):
    config = tiny_config("qwen2")
    with layerswap.use_bundle("qwen2-fused_qkv"):
        model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(tmp_path)
    saved = read_checkpoint(tmp_path)
    assert saved["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    assert saved["model.layers.0.self_attn.k_proj.bias"].shape == (32,)
    stock, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    _assert_clean(info)
    expected = model.model.layers[1].self_attn.qkv_proj.weight
    actual = stock.model.layers[1].self_attn
    assert torch.equal(
        torch.cat([actual.q_proj.weight, actual.k_proj.weight, actual.v_proj.weight]), expected
    )


def test_a_checkpoint_missing_a_projection_is_an_error(checkpoint, tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    dropped = drop_keys(tmp_path, lambda key: key == "model.layers.1.self_attn.k_proj.weight")
    assert dropped
    with pytest.raises(MissingExpertWeightsError, match=r"layers\.1\.self_attn\.qkv_proj\.weight"):
        _load_with(tmp_path, "llama-fused_qkv")


def test_split_uses_the_exact_gqa_widths():
    config = tiny_config("llama")  # 4 heads, 2 kv heads, head_dim 16
    fused = torch.arange(128.0)[:, None].expand(128, 3).contiguous()
    targets = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]
    parts = SplitQKV().convert(
        {"self_attn.qkv_proj.weight": fused}, ["self_attn.qkv_proj.weight"], targets, config=config
    )
    assert [parts[t].shape[0] for t in targets] == [64, 32, 32] == list(config_qkv_sizes(config))
    assert torch.equal(torch.cat([parts[t] for t in targets]), fused)
    # The trap SplitQKV avoids: transformers' Concatenate reverses to an equal-size Chunk.
    chunked = Concatenate(dim=0).reverse_op.convert({"qkv": fused}, ["qkv"], targets)
    assert [chunked[t].shape[0] for t in targets] != [64, 32, 32]
    with pytest.raises(ValueError, match="cannot split"):
        SplitQKV().convert({"qkv": fused[:100]}, ["qkv"], targets, config=config)


def test_concatenate_and_split_are_exact_inverses():
    q, k, v = torch.randn(64, 8), torch.randn(32, 8), torch.randn(32, 8)
    sources = ["q_proj.weight", "k_proj.weight", "v_proj.weight"]
    fused = ConcatenateQKV().convert(
        {"v_proj.weight": [v], "q_proj.weight": [q], "k_proj.weight": [k]}, sources, ["qkv_proj.weight"]
    )["qkv_proj.weight"]
    assert torch.equal(fused, torch.cat([q, k, v]))
    assert isinstance(ConcatenateQKV().reverse_op, SplitQKV)
    assert isinstance(SplitQKV().reverse_op, ConcatenateQKV)
    with pytest.raises(ValueError, match="lacks"):
        ConcatenateQKV().convert({"q_proj.weight": q}, sources, ["qkv_proj.weight"])


def test_converter_reverse_is_a_split():
    converter = fused_qkv_conversions([], options=None)[0]
    assert isinstance(converter, WeightConverter) and converter.was_used()
    reverse = converter.reverse_transform()
    assert isinstance(reverse.operations[0], SplitQKV)
    assert reverse._original_source_patterns == ["self_attn.qkv_proj.weight"]
