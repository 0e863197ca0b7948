"""MoE families whose experts are already nn.Linear (switch_transformers, nllb-moe) need no bundle: checked on the
installed transformers, so the claim `layerswap list` makes stays true. Stock tiny checkpoints: every expert
parameter is in an exact nn.Linear, bitsandbytes nf4 quantizes every expert Linear, and the checkpoint saves back
bitwise."""

import re

import pytest
import torch
from torch import nn

from _support.bnb import quantization_config
from _support.checkpoints import assert_state_dicts_identical, read_checkpoint
from _support.tiny_models import auto_class, text_logits, tiny_input_ids, tiny_model
from _support.transformers_support import needs_model_type
from layerswap.families import ALREADY_LINEAR
from layerswap.quantized import is_quantized_linear


def _expert_parameters(model):
    return {name: p for name, p in model.named_parameters() if ".experts." in name}


# Expert projections a scheme must leave unquantized, with the reason `layerswap list` gives: stock
# SwitchTransformersDenseActDense casts its input to `wo.weight.dtype` unless that is int8, and a 4-bit weight is
# packed as uint8, so a 4-bit `wo` computes on activations cast to uint8 (logits measured at cosine -0.07 to stock).
_KEPT = {("switch_transformers", "nf4"): [r".*\.wo"]}


@pytest.mark.parametrize("scheme", ["nf4", "int8"])
@pytest.mark.parametrize(
    "model_type", [pytest.param(t, marks=needs_model_type(t)) for t in sorted(ALREADY_LINEAR)]
)
def test_already_linear_experts_quantize_and_round_trip_with_no_bundle(model_type, scheme, tmp_path):
    stock = tiny_model(model_type)
    experts = _expert_parameters(stock)
    assert experts, f"{model_type}: no parameter under an '.experts.' module"
    linear_owners = {
        f"{module_name}.{name}"
        for module_name, module in stock.named_modules()
        if type(module) is nn.Linear
        for name, _ in module.named_parameters(recurse=False)
    }
    assert set(experts) <= linear_owners, sorted(set(experts) - linear_owners)[:4]

    stock.save_pretrained(tmp_path / "stock")
    kept = _KEPT.get((model_type, scheme), [])
    config = quantization_config(scheme, model_type)
    config.llm_int8_skip_modules = [*(config.llm_int8_skip_modules or []), *kept]
    quantized = auto_class(model_type).from_pretrained(tmp_path / "stock", quantization_config=config)
    expert_linears = {
        n: m for n, m in quantized.named_modules() if ".experts." in n and isinstance(m, nn.Linear)
    }
    assert expert_linears
    for name, module in expert_linears.items():
        assert is_quantized_linear(module) != any(re.fullmatch(k, name) for k in kept), name
    input_ids = tiny_input_ids()
    with torch.no_grad():
        reference, logits = text_logits(stock, input_ids), text_logits(quantized, input_ids)
    assert torch.isfinite(logits).all()
    # Tiny random models amplify quantization error (switch's logits reach 27): the bound only catches garbage.
    similarity = torch.nn.functional.cosine_similarity(logits.flatten(), reference.flatten(), dim=0)
    assert similarity > 0.9, f"logits at cosine {similarity:.3f} to stock"

    reloaded, info = auto_class(model_type).from_pretrained(tmp_path / "stock", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    reloaded.save_pretrained(tmp_path / "again")
    first, second = read_checkpoint(tmp_path / "stock"), read_checkpoint(tmp_path / "again")
    assert set(first) == set(second) and all(torch.equal(first[k], second[k]) for k in first)
    assert_state_dicts_identical(stock, reloaded)
