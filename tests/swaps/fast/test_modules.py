"""fused_experts_forward and the "layerswap" experts backend against the stock experts they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

from _support.tiny_models import tiny_config, tiny_input_ids, tiny_model
from layerswap.kernels import KernelInputError
from layerswap.swaps.fast import modules as fused_experts
from layerswap.swaps.fast.modules import (
    FusedExpertsForwardMixin,
    activation_name,
    fused_experts_forward,
    register_experts_backend,
    unregister_experts_backend,
)

FAMILIES = ["qwen2_moe", "mixtral", "qwen3_moe", "olmoe"]


def first_experts(model: nn.Module) -> nn.Module:
    return next(m for name, m in model.named_modules() if name.endswith("mlp.experts"))


def scale_experts(model: nn.Module) -> None:
    # The stock init (std 0.02) makes expert outputs so small that any atol would pass; 0.2 makes them count.
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)


def routing(num_tokens: int, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    index = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    return index, torch.rand(num_tokens, top_k, generator=generator).softmax(-1)


def interface_state() -> tuple[dict, dict]:
    return dict(ALL_EXPERTS_FUNCTIONS._global_mapping), dict(ALL_EXPERTS_FUNCTIONS._local_mapping)


# T=3: every expert has few rows (fp32 row-major path); T=64: 16 rows per expert (weight-major path).
@pytest.mark.parametrize("num_tokens", [3, 64])
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_matches_stock(family: str, num_tokens: int) -> None:
    model = tiny_model(family)
    scale_experts(model)
    experts = first_experts(model)
    x = torch.randn(num_tokens, model.config.hidden_size)
    index, weights = routing(num_tokens, experts.num_experts, model.config.num_experts_per_tok)
    experts.config._experts_implementation = "eager"  # this model's own config
    with torch.no_grad():
        expected = experts(x, index, weights)
        got = fused_experts_forward(experts, x, index, weights)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# Each CPU strategy the dispatch can pick (forced, so none goes untested on a CPU that would not pick it),
# through the experts backend, in bf16 against stock grouped_mm: T=2 (one row per expert, the direct side of
# upcast), T=64 (16 rows per expert, converted to fp32); layerswap on one engine, and on two worker threads
# (the model's weights require grad: the workers must run under the caller's no_grad).
@pytest.mark.parametrize("num_tokens", [2, 64])
@pytest.mark.parametrize(
    "strategy", ["stock", "layerswap", "layerswap:row", "layerswap:wm", "layerswap:row:2", "upcast"]
)
def test_every_cpu_strategy_matches_stock_bf16(
    monkeypatch: pytest.MonkeyPatch, strategy: str, num_tokens: int
) -> None:
    monkeypatch.setenv("LAYERSWAP_CPU_STRATEGY", strategy)
    model = tiny_model("qwen3_moe")
    scale_experts(model)
    experts = first_experts(model).to(torch.bfloat16)
    x = torch.randn(num_tokens, model.config.hidden_size).bfloat16()
    index, weights = routing(num_tokens, experts.num_experts, model.config.num_experts_per_tok)
    experts.config._experts_implementation = "grouped_mm"
    with torch.no_grad():
        expected = experts(x, index, weights.bfloat16())
        got = fused_experts_forward(experts, x, index, weights.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=5e-2, rtol=5e-2)


# The whole model through the layerswap backend gives eager's logits: as calibrated under no_grad, and on the
# worker threads under inference_mode (per thread, like no_grad, so the workers must take the caller's).
@pytest.mark.parametrize(
    "mode, strategy",
    [("no_grad", None), ("inference_mode", "layerswap:row:2")],
    ids=["calibrated", "workers"],
)
def test_whole_model_with_layerswap_backend_matches_eager(
    monkeypatch: pytest.MonkeyPatch, mode: str, strategy: str | None
) -> None:
    if strategy is not None:
        monkeypatch.setenv("LAYERSWAP_CPU_STRATEGY", strategy)
    calls = []
    real_fused_moe = fused_experts.fused_moe
    monkeypatch.setattr(
        fused_experts, "fused_moe", lambda *a, **k: calls.append(1) or real_fused_moe(*a, **k)
    )
    model = tiny_model("qwen2_moe")
    scale_experts(model)
    input_ids = tiny_input_ids()
    register_experts_backend()
    try:
        with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
            model.set_experts_implementation("eager")
            expected = model(input_ids).logits
            model.set_experts_implementation("layerswap")
            got = model(input_ids).logits
    finally:
        unregister_experts_backend()
    assert len(calls) == model.config.num_hidden_layers  # the fused path really ran, once per MoE layer
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_from_config_accepts_layerswap_backend() -> None:
    register_experts_backend()
    try:
        model = tiny_model("qwen2_moe", experts_implementation="layerswap")
        assert model.config._experts_implementation == "layerswap"
    finally:
        unregister_experts_backend()


def test_unregister_restores_interface_exactly() -> None:
    before = interface_state()
    register_experts_backend()
    try:
        register_experts_backend()  # idempotent: a second call must not record our own entry as the original
        assert ALL_EXPERTS_FUNCTIONS["layerswap"] is fused_experts_forward
        assert "layerswap" in ALL_EXPERTS_FUNCTIONS.valid_keys()
    finally:
        unregister_experts_backend()
    assert interface_state() == before
    assert "layerswap" not in ALL_EXPERTS_FUNCTIONS


# Someone else's "layerswap" entry (a user's or an older version's) must come back, not be deleted.
def test_unregister_restores_a_previous_entry() -> None:
    def previous(self, hidden_states, top_k_index, top_k_weights):
        raise AssertionError("not called")

    ALL_EXPERTS_FUNCTIONS["layerswap"] = previous
    try:
        before = interface_state()
        register_experts_backend()
        assert ALL_EXPERTS_FUNCTIONS["layerswap"] is fused_experts_forward
        unregister_experts_backend()
        assert interface_state() == before
        assert ALL_EXPERTS_FUNCTIONS["layerswap"] is previous
    finally:
        unregister_experts_backend()
        del ALL_EXPERTS_FUNCTIONS._local_mapping["layerswap"]


def test_mixin_subclass_matches_stock() -> None:
    class FusedQwen2MoeExperts(FusedExpertsForwardMixin, Qwen2MoeExperts):
        pass

    config = tiny_config("qwen2_moe")
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    fused = FusedQwen2MoeExperts(config)
    with torch.no_grad():
        fused.gate_up_proj.normal_(0, 0.2)
        fused.down_proj.normal_(0, 0.2)
    stock = Qwen2MoeExperts(config)
    stock.load_state_dict(fused.state_dict())  # same parameter names: checkpoints load into either
    x = torch.randn(11, config.hidden_size)
    index, weights = routing(11, config.num_experts, config.num_experts_per_tok)
    with torch.no_grad():
        torch.testing.assert_close(fused(x, index, weights), stock(x, index, weights), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "act_fn, expected",
    [
        (ACT2FN["silu"], "silu"),
        (nn.SiLU(), "silu"),
        (F.silu, "silu"),  # lfm2_moe uses the function itself
        (ACT2FN["gelu"], "gelu"),
        (ACT2FN["gelu_pytorch_tanh"], "gelu_pytorch_tanh"),
        (nn.GELU(approximate="tanh"), "gelu_pytorch_tanh"),
        (ACT2FN["relu"], "relu"),
        (ACT2FN["gelu_python_tanh"], None),  # same class as gelu_pytorch_tanh, but its own python formula
        (ACT2FN["quick_gelu"], None),  # unknown to the kernels: passed on as a callable
    ],
)
def test_activation_name(act_fn, expected: str | None) -> None:
    assert activation_name(act_fn) == expected


# An activation the kernels do not know still gives the stock result, through the torch path's callable.
def test_unknown_activation_runs_as_callable() -> None:
    config = tiny_config("qwen2_moe", hidden_act="quick_gelu")
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    experts = Qwen2MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    x = torch.randn(5, config.hidden_size)
    index, weights = routing(5, config.num_experts, config.num_experts_per_tok)
    with torch.no_grad():
        torch.testing.assert_close(
            fused_experts_forward(experts, x, index, weights),
            experts(x, index, weights),
            atol=1e-5,
            rtol=1e-5,
        )


# Layouts the kernels would compute wrongly are refused, with both the class and the flag in the message.
@pytest.mark.parametrize("flag, value", [("has_bias", True), ("is_transposed", True)])
def test_other_layouts_are_refused(flag: str, value: bool) -> None:
    experts = Qwen2MoeExperts(tiny_config("qwen2_moe"))
    setattr(experts, flag, value)
    x = torch.randn(2, experts.hidden_dim)
    index, weights = routing(2, experts.num_experts, 2)
    with pytest.raises(KernelInputError, match=rf"Qwen2MoeExperts\.{flag} is {value}"):
        fused_experts_forward(experts, x, index, weights)


# Under expert parallelism a rank holds its own experts and marks the routes to other ranks' experts with id E
# (weight 0): stock skips them, and so do the kernels.
def test_expert_parallel_experts_skip_the_other_ranks_routes() -> None:
    experts = Qwen2MoeExperts(tiny_config("qwen2_moe"))
    for parameter in experts.parameters():  # built directly: nothing initialised them
        nn.init.normal_(parameter, std=0.2)
    experts._is_expert_parallel = True
    x = torch.randn(6, experts.hidden_dim)
    index, weights = routing(6, experts.num_experts, 2)
    index[::2, 0] = experts.num_experts
    weights[::2, 0] = 0.0
    experts.config._experts_implementation = "eager"
    with torch.no_grad():
        expected = experts(x, index, weights)
        got = fused_experts_forward(experts, x, index, weights)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# A custom _apply_gate (clamped gates, interleaved gate/up) changes the math the kernels hard-code.
def test_custom_gate_is_refused() -> None:
    class ClampedExperts(Qwen2MoeExperts):
        def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up_out.chunk(2, dim=-1)
            return self.act_fn(gate.clamp(max=7.0)) * up

    experts = ClampedExperts(tiny_config("qwen2_moe"))
    index, weights = routing(2, experts.num_experts, 2)
    with pytest.raises(KernelInputError, match="ClampedExperts overrides _apply_gate"):
        fused_experts_forward(experts, torch.randn(2, experts.hidden_dim), index, weights)


# The backend inside a whole model must not break the graph: the layout checks are attribute reads, and the
# kernels are one custom op (aot_eager: dynamo and AOT tracing without inductor's C++ build time).
def test_whole_model_compiles_fullgraph_with_layerswap_backend() -> None:
    model = tiny_model("qwen2_moe")
    input_ids = tiny_input_ids()
    register_experts_backend()
    torch._dynamo.reset()
    try:
        model.set_experts_implementation("layerswap")
        with torch.no_grad():
            compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(
                input_ids, use_cache=False
            ).logits
            eager = model(input_ids, use_cache=False).logits
    finally:
        torch._dynamo.reset()
        unregister_experts_backend()
    torch.testing.assert_close(compiled, eager)
