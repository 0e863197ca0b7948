"""The load guard's 'swapped nothing' warning: when another tool (Defuser, GPTQModel, auto-round) replaced the
modules a bundle swaps before the bundle could, the warning names that tool's class instead of telling the user to
enable the bundle they enabled."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.qwen2_moe import modeling_qwen2_moe

import layerswap
from _support.tiny_models import tiny_config, tiny_model


class LinearQwen2MoeSparseMoeBlock(nn.Module):
    """What Defuser's `replace_fused_blocks("qwen2_moe")` binds in place of Qwen2MoeSparseMoeBlock (defuser 0.0.28,
    defuser.modeling.unfused_moe.qwen2_moe): the stock router, and the experts as an nn.ModuleList of stock MLPs."""

    def __init__(self, config):
        super().__init__()
        self.gate = modeling_qwen2_moe.Qwen2MoeTopKRouter(config)
        self.experts = nn.ModuleList(
            modeling_qwen2_moe.Qwen2MoeMLP(config, intermediate_size=config.moe_intermediate_size)
            for _ in range(config.num_experts)
        )
        self.shared_expert = modeling_qwen2_moe.Qwen2MoeMLP(
            config, intermediate_size=config.shared_expert_intermediate_size
        )
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states):
        return hidden_states


class ForeignExperts(nn.Module):
    """Another library's fused experts (3D weights, no nn.Linear), under a name of its own."""

    def __init__(self, config):
        super().__init__()
        self.weights = nn.Parameter(torch.zeros(config.num_experts, 2, config.hidden_size))


class BlockWithForeignExperts(LinearQwen2MoeSparseMoeBlock):
    def __init__(self, config):
        super().__init__(config)
        self.experts = ForeignExperts(config)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2_moe")
    tiny_model("qwen2_moe").save_pretrained(directory)
    return directory


def _load_quietly(directory):
    # The stand-ins take none of the stock checkpoint's expert weights (Defuser brings conversions of its own).
    return AutoModelForCausalLM.from_pretrained(directory, config=tiny_config("qwen2_moe"))


def test_experts_already_split_by_another_tool_are_named_instead_of_asking_to_enable_the_bundle(
    checkpoint, monkeypatch
):
    monkeypatch.setattr(modeling_qwen2_moe, "Qwen2MoeSparseMoeBlock", LinearQwen2MoeSparseMoeBlock)
    with layerswap.use_bundle("qwen2_moe-quant"), pytest.warns(layerswap.LayerswapWarning) as caught:
        model = _load_quietly(checkpoint)
    assert isinstance(model.model.layers[0].mlp, LinearQwen2MoeSparseMoeBlock)
    (message,) = [str(w.message) for w in caught]
    assert "swapped nothing" in message and "another tool" in message
    assert f"{__name__}.LinearQwen2MoeSparseMoeBlock (its experts: ModuleList of Qwen2MoeMLP)" in message
    assert "model.layers.0.mlp.experts" in message and "not the stock Qwen2MoeExperts" in message
    assert "it holds nn.Linear layers already" in message and "Disable 'qwen2_moe-quant'" in message
    assert "Enable the bundle" not in message


def test_a_foreign_experts_class_without_linear_layers_is_named_too(checkpoint, monkeypatch):
    monkeypatch.setattr(modeling_qwen2_moe, "Qwen2MoeSparseMoeBlock", BlockWithForeignExperts)
    with layerswap.use_bundle("qwen2_moe-quant"), pytest.warns(layerswap.LayerswapWarning) as caught:
        _load_quietly(checkpoint)
    (message,) = [str(w.message) for w in caught]
    assert f"is {__name__}.ForeignExperts, not the stock Qwen2MoeExperts" in message
    assert "it holds no class this bundle can swap" in message and "Enable the bundle" not in message


def test_a_model_of_another_family_still_asks_for_its_own_bundle(tmp_path):
    tiny_model("olmoe").save_pretrained(tmp_path)
    with layerswap.use_bundle("qwen2_moe-quant"), pytest.warns(layerswap.LayerswapWarning) as caught:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    (message,) = [str(w.message) for w in caught]
    assert "Enable the bundle for this model's family" in message and "another tool" not in message
