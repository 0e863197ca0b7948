"""bitsandbytes 4-bit and 8-bit on CPU: with a -quant bundle every expert linear is quantized and forward runs."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import layerswap
from _support.bnb import quantization_config
from _support.families import MOE_FAMILIES
from _support.numerics import assert_computed_close
from _support.tiny_models import auto_class, text_logits, tiny_input_ids, tiny_model
from _support.transformers_support import needs_bundle


@pytest.fixture(scope="module", params=MOE_FAMILIES, ids=lambda f: f.model_type)
def checkpoint(request, tmp_path_factory):
    family = request.param
    model = tiny_model(family.model_type)
    directory = tmp_path_factory.mktemp(family.model_type)
    model.save_pretrained(directory)
    with torch.no_grad():
        logits = text_logits(model, tiny_input_ids())
    return family, directory, logits


@pytest.mark.parametrize("scheme", ["nf4", "int8"])
def test_every_expert_linear_is_quantized_and_forward_runs(checkpoint, scheme):
    family, directory, reference = checkpoint
    with layerswap.use_bundle(f"{family.model_type}-quant"):
        model = auto_class(family.model_type).from_pretrained(
            directory, quantization_config=quantization_config(scheme, family.model_type)
        )
    summary = layerswap.report(model)
    assert summary.expert_params > 0
    assert summary.expert_quantized_params == summary.expert_params, str(summary)
    with torch.no_grad():
        logits = text_logits(model, tiny_input_ids())
    assert torch.isfinite(logits).all()
    # Tiny random models amplify quantization error; the bound only catches garbage (e.g. random experts).
    assert (logits - reference).abs().max() < 0.5 * reference.abs().max() + 1.0


@pytest.mark.parametrize("scheme", ["nf4", "int8"])
def test_a_quantized_model_saves_and_reloads_with_the_bundle_exactly(checkpoint, scheme, tmp_path):
    # Quantized experts save one by one (granitemoe's stock layout is fused, but packed 4-bit weights with their
    # quant states, or int8 weights with their scales, cannot be stacked into one tensor). Saved before any forward:
    # bitsandbytes' CPU 4-bit forward rewrites `absmax` in place for some shapes (stock llama too), after which a
    # save no longer reloads to the same outputs.
    family, directory, _ = checkpoint
    with layerswap.use_bundle(f"{family.model_type}-quant"):
        model = auto_class(family.model_type).from_pretrained(
            directory, quantization_config=quantization_config(scheme, family.model_type)
        )
        model.save_pretrained(tmp_path)
        reloaded = auto_class(family.model_type).from_pretrained(tmp_path)
    assert layerswap.report(reloaded).expert_quantized_share == 1.0
    saved, loaded = model.state_dict(), reloaded.state_dict()
    assert saved.keys() == loaded.keys()
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, loaded[key]), key
    with torch.no_grad():
        assert_computed_close(text_logits(reloaded, tiny_input_ids()), text_logits(model, tiny_input_ids()))


@pytest.mark.parametrize("scheme", ["nf4", "int8"])
@pytest.mark.parametrize(
    ("model_type", "bundle"),
    [
        pytest.param("llama", "llama-fused_qkv", marks=needs_bundle("llama-fused_qkv")),
        pytest.param("qwen2_moe", "qwen2_moe-fast", marks=needs_bundle("qwen2_moe-fast")),
    ],
)
def test_a_quantized_fused_qkv_model_saves_qkv_proj_as_is_and_reloads_exactly(
    model_type, bundle, scheme, tmp_path
):
    # A quantized qkv_proj cannot be split into q/k/v (4-bit rows are packed with their quant state), so it saves
    # fused and the bundle loads it back. The -fast bundle also keeps qwen2_moe's 1-wide shared_expert_gate out of
    # 4-bit, which bitsandbytes' CPU kernel rejects (as it does on a stock load).
    source, saved = tmp_path / "source", tmp_path / "saved"
    tiny_model(model_type).save_pretrained(source)
    with layerswap.use_bundle(bundle):
        model = AutoModelForCausalLM.from_pretrained(source, quantization_config=quantization_config(scheme))
        model.save_pretrained(saved)
        reloaded = AutoModelForCausalLM.from_pretrained(saved)
    from safetensors import safe_open

    with safe_open(str(saved / "model.safetensors"), "pt") as checkpoint:
        keys = set(checkpoint.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in keys
    assert not any(".q_proj." in key for key in keys)
    with torch.no_grad():
        assert_computed_close(text_logits(reloaded, tiny_input_ids()), text_logits(model, tiny_input_ids()))


def test_stock_transformers_leaves_experts_unquantized_and_report_says_so(tmp_path):
    tiny_model("qwen2_moe").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization_config("nf4"))
    summary = layerswap.report(model)
    assert summary.expert_params > 0 and summary.expert_quantized_params == 0
    assert any("none of its expert parameters" in w for w in summary.warnings)


def test_routers_and_one_wide_gates_stay_unquantized_by_default_and_can_be_overridden(tmp_path):
    tiny_model("qwen2_moe").save_pretrained(tmp_path)
    with layerswap.use_bundle("qwen2_moe-quant"):
        model = AutoModelForCausalLM.from_pretrained(
            tmp_path, quantization_config=quantization_config("int8")
        )
    gate = model.model.layers[0].mlp.shared_expert_gate
    assert type(gate) is torch.nn.Linear
    with layerswap.use_bundle("qwen2_moe-quant", keep_unquantized=()):
        model = AutoModelForCausalLM.from_pretrained(
            tmp_path, quantization_config=quantization_config("int8")
        )
    assert type(model.model.layers[0].mlp.shared_expert_gate).__name__ == "Linear8bitLt"


def test_bundle_quantized_footprint_is_smaller_than_stock(tmp_path):
    tiny_model("qwen2_moe").save_pretrained(tmp_path)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization_config("nf4"))
    with layerswap.use_bundle("qwen2_moe-quant"):
        ours = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization_config("nf4"))
    assert ours.get_memory_footprint() < 0.6 * stock.get_memory_footprint()


def test_a_quantized_bundle_load_trims_the_heap_as_it_quantizes_and_an_unquantized_one_does_not(
    tmp_path, monkeypatch
):
    from layerswap._hf import quantizers

    tiny_model("qwen2_moe").save_pretrained(tmp_path)
    trims = []
    monkeypatch.setattr(quantizers, "trim_heap", lambda: trims.append(True))
    with layerswap.use_bundle("qwen2_moe-quant"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
        assert trims == []
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization_config("nf4"))
        assert trims == [True]  # the tiny model is far below TRIM_EVERY_BYTES: only the trim at the end
        monkeypatch.setattr(quantizers, "TRIM_EVERY_BYTES", 1)
        model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization_config("nf4"))
    quantized = sum(1 for m in model.modules() if type(m).__name__ == "Linear4bit")
    assert len(trims) == 1 + quantized + 1
    # Stock transformers' own loads are left alone.
    trims.clear()
    AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization_config("nf4"))
    assert trims == []
