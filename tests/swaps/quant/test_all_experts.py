"""Calibration pipelines that ask for every expert to see every token get it from LinearExperts.

llm-compressor (0.14) calibrates MoE experts on every token by default: `oneshot(moe_calibrate_all_experts=True)`
enters `llmcompressor.modeling.moe.context.moe_calibration_context()`, which sets a module flag that its own
linearised experts read (`get_calibrate_all_experts_flag()`). A model loaded under '<family>-quant' has
layerswap's LinearExperts instead, which must read the same flag: otherwise experts the calibration set never
routes to are quantized with uninitialised scales (measured with the real tool: 27 of 48 expert tensors of a tiny
qwen2_moe, calibrated on 4 tokens, had garbage scales). These tests stand in a module shaped like llm-compressor's
(tests/integration/ runs the real one), so they need no llm-compressor.
"""

import contextlib
import sys
import types

import pytest
import torch
from torch import nn

import layerswap
from _support.tiny_models import tiny_model
from layerswap.calibration import calibrate_all_experts
from layerswap.errors import LayerswapWarning
from layerswap.swaps.quant.all_experts import LLM_COMPRESSOR_SWITCH_MODULE
from layerswap.swaps.quant.modules import LinearExperts

MODEL_TYPE = "qwen2_moe"  # 2 MoE layers, 8 experts, top_k 2
# Two tokens, top_k 2: at most 4 of the 8 experts of a layer get a token, so some get none.
FEW_TOKENS = torch.tensor([[5, 17]])


def _fake_llm_compressor_switch() -> types.ModuleType:
    """llmcompressor/modeling/moe/context.py as llm-compressor 0.14.0.1 ships it."""
    module = types.ModuleType(LLM_COMPRESSOR_SWITCH_MODULE)
    module._CALIBRATE_ALL_EXPERTS = False

    def get_calibrate_all_experts_flag() -> bool:
        return module._CALIBRATE_ALL_EXPERTS

    @contextlib.contextmanager
    def moe_calibration_context():
        restore_value, module._CALIBRATE_ALL_EXPERTS = module._CALIBRATE_ALL_EXPERTS, True
        try:
            yield
        finally:
            module._CALIBRATE_ALL_EXPERTS = restore_value

    module.get_calibrate_all_experts_flag = get_calibrate_all_experts_flag
    module.moe_calibration_context = moe_calibration_context
    return module


@pytest.fixture
def llm_compressor_switch(monkeypatch):
    switch = _fake_llm_compressor_switch()
    monkeypatch.setitem(sys.modules, LLM_COMPRESSOR_SWITCH_MODULE, switch)
    return switch


@pytest.fixture(scope="module")
def quant_model():
    with layerswap.use_bundle(f"{MODEL_TYPE}-quant"):
        return tiny_model(MODEL_TYPE)


def _rows_per_expert_linear(model, input_ids):
    """(rows each expert nn.Linear saw, logits) for one forward."""
    seen, handles = {}, []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and ".experts." in name:
            seen[name] = 0

            def count(module, args, output, name=name):
                seen[name] += args[0].shape[0]

            handles.append(module.register_forward_hook(count))
    try:
        with torch.no_grad():
            logits = model(input_ids).logits
    finally:
        for handle in handles:
            handle.remove()
    return seen, logits


def test_few_tokens_leave_experts_without_calibration_data(quant_model):
    # The premise of the tests below: routed alone, some experts see no calibration token.
    seen, _ = _rows_per_expert_linear(quant_model, FEW_TOKENS)
    assert len(seen) == 2 * 8 * 3
    assert any(rows == 0 for rows in seen.values())


def test_llm_compressor_all_experts_switch_feeds_every_token_to_every_expert(
    quant_model, llm_compressor_switch
):
    _, expected = _rows_per_expert_linear(quant_model, FEW_TOKENS)
    with llm_compressor_switch.moe_calibration_context():
        seen, calibrated = _rows_per_expert_linear(quant_model, FEW_TOKENS)
    assert set(seen.values()) == {FEW_TOKENS.numel()}  # every expert, each token exactly once
    assert torch.equal(calibrated, expected)  # the layer output is still the routed one
    routed_again, _ = _rows_per_expert_linear(quant_model, FEW_TOKENS)  # the switch is read on each call
    assert any(rows == 0 for rows in routed_again.values())


def test_llm_compressor_switch_off_keeps_routed_calibration(quant_model, llm_compressor_switch):
    # oneshot(moe_calibrate_all_experts=False) leaves the flag off: the user asked for routed-only statistics.
    seen, _ = _rows_per_expert_linear(quant_model, FEW_TOKENS)
    assert any(rows == 0 for rows in seen.values())


def test_calibrate_all_experts_inside_llm_compressor_switch_feeds_each_token_once(
    quant_model, llm_compressor_switch
):
    # Wrapping oneshot in calibrate_all_experts (the workaround before the switch was read) must not feed the
    # unrouted tokens twice: GPTQ's statistics would weigh them double.
    with llm_compressor_switch.moe_calibration_context(), calibrate_all_experts(quant_model):
        seen, _ = _rows_per_expert_linear(quant_model, FEW_TOKENS)
    assert set(seen.values()) == {FEW_TOKENS.numel()}


def test_calibrate_all_experts_alone_feeds_every_expert_and_restores(quant_model):
    with calibrate_all_experts(quant_model, chunk_size=1):  # 1 < 2 tokens: several chunks per expert
        seen, _ = _rows_per_expert_linear(quant_model, FEW_TOKENS)
    assert set(seen.values()) == {FEW_TOKENS.numel()}
    after, _ = _rows_per_expert_linear(quant_model, FEW_TOKENS)
    assert any(rows == 0 for rows in after.values())
    assert all(not m._forward_hooks for m in quant_model.modules() if isinstance(m, LinearExperts))


def test_an_unreadable_llm_compressor_switch_warns_once_naming_the_fix(quant_model, monkeypatch):
    # A later llm-compressor that moves its switch: say so, instead of silently calibrating routed tokens only.
    changed = types.ModuleType(LLM_COMPRESSOR_SWITCH_MODULE)
    monkeypatch.setitem(sys.modules, LLM_COMPRESSOR_SWITCH_MODULE, changed)
    monkeypatch.setattr("layerswap.swaps.quant.all_experts._warned_unreadable_switch", False)
    with pytest.warns(
        LayerswapWarning, match="llm-compressor.*get_calibrate_all_experts_flag.*calibrate_all_experts"
    ):
        _rows_per_expert_linear(quant_model, FEW_TOKENS)
    _rows_per_expert_linear(quant_model, FEW_TOKENS)  # once per process: no second warning (an error here)


# Other layouts LinearExperts serves: mixtral's w1/w3/w2 names, gpt_oss's biased interleaved experts called with
# its own argument names, dbrx's experts called with [B, S, H] hidden states.
@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss", "dbrx"])
def test_the_switch_reaches_every_expert_of_other_layouts(model_type, llm_compressor_switch):
    with layerswap.use_bundle(f"{model_type}-quant"):
        model = tiny_model(model_type)
    _, expected = _rows_per_expert_linear(model, FEW_TOKENS)
    with llm_compressor_switch.moe_calibration_context():
        seen, calibrated = _rows_per_expert_linear(model, FEW_TOKENS)
    assert seen and set(seen.values()) == {FEW_TOKENS.numel()}
    assert torch.equal(calibrated, expected)
