"""Replayable routers against the stock routers they subclass, for every family with a '-replay' bundle."""

import importlib
from itertools import chain

import pytest
import torch
from transformers import AutoModelForCausalLM

import layerswap
from _support.families import INSTALLED_FAMILIES
from _support.numerics import assert_computed_close
from _support.tiny_models import text_logits, tiny_input_ids, tiny_model
from layerswap._hf import compat as _compat
from layerswap.catalog import CATALOG
from layerswap.families import FAMILIES, TYPED, families_without_replay
from layerswap.routing import moe_routers, record_routing, replay_routing
from layerswap.swaps.replay.modules import SCORERS, UNREPLAYABLE, ReplayableRouter, scorer_for

# As the installed transformers can test them (families.INSTALLED_FAMILIES), less the '-replay' bundles it is too
# old for (test_compat checks that those refuse, naming the release they need).
REPLAY_FAMILIES = [
    f
    for f in INSTALLED_FAMILIES
    if f.router
    and f"{f.model_type}-replay" in CATALOG
    and _compat.bundle_requirement(CATALOG[f"{f.model_type}-replay"]) is None
]
REPLAY_TYPES = [f.model_type for f in REPLAY_FAMILIES]

# Config branches the default tiny configs do not take, so every line of every scorer runs once.
BRANCH_VARIANTS = [
    ("qwen2_moe", {"norm_topk_prob": True}),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1}),
    ("deepseek_v3", {"norm_topk_prob": False}),
    ("cohere2_moe", {"expert_selection_fn": "sigmoid"}),
    ("lfm2_moe", {"use_expert_bias": False, "norm_topk_prob": False}),
    ("laguna", {"moe_router_logit_softcapping": 5.0}),
]


def _randomize_selection_biases(model):
    # Correction biases (deepseek_v3 and its copies, minimax_m2, lfm2_moe, afmoe, ernie's moe_statics, laguna)
    # start at zero; non-zero ones make selection differ from the plain top-k of the weights, as in real
    # checkpoints, which is what a scorer that wrongly used them would get caught by.
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, tensor in chain(model.named_parameters(), model.named_buffers()):
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.05)


def _stock_and_replayable(model_type, **overrides):
    stock = tiny_model(model_type, **overrides)
    _randomize_selection_biases(stock)
    with layerswap.use_bundle(f"{model_type}-replay"):
        replayable = tiny_model(model_type, **overrides)
    replayable.load_state_dict(stock.state_dict())
    with torch.no_grad():
        for name, buffer in stock.named_buffers():
            replayable.get_buffer(name).copy_(buffer)
    return stock, replayable


# phimoe's sparsemixer weighs a choice by a softmax over the experts within 2 * router_jitter_noise (relative)
# of the best: a constant 1, with no gradient (in stock too), when the choice is alone in that window, as it
# mostly is at the default 0.01 with tiny random weights. A wider window lets gradients show.
PHIMOE_WIDE_WINDOW = {"router_jitter_noise": 0.5}
TRAINING_OVERRIDES = {"phimoe": PHIMOE_WIDE_WINDOW}


def _trainable_router_parameters(model):
    return [p for _, router in moe_routers(model) for p in router.parameters() if p.requires_grad]


def test_every_typed_router_has_a_replay_bundle_and_the_derived_ones_are_listed():
    # A hand-written row names its router for its '-replay' bundle: one without a scorer would silently get none.
    # A derived row's router has no scorer until someone mirrors its math; `layerswap list --markdown` lists those.
    routers = {f.router for f in TYPED if f.router}
    missing = routers - set(SCORERS) - set(UNREPLAYABLE)
    assert not missing, f"routers without a replay scorer: {sorted(missing)}"
    replayable = {f.model_type for f in FAMILIES if scorer_for(f.router) is not None}
    assert {f.model_type for f in FAMILIES if f"{f.model_type}-replay" in CATALOG} == replayable
    assert {f.model_type for f in FAMILIES if f.experts} - replayable == set(families_without_replay())


@pytest.mark.parametrize("family", REPLAY_FAMILIES, ids=lambda f: f.model_type)
def test_replacement_subclasses_the_stock_router(family):
    # _init_weights and OutputRecorder(StockRouter) match by isinstance.
    stock_cls = getattr(importlib.import_module(family.modeling_module), family.router)
    with layerswap.use_bundle(f"{family.model_type}-replay"):
        model = tiny_model(family.model_type)
    routers = moe_routers(model)
    assert routers
    for _, router in routers:
        assert isinstance(router, stock_cls) and isinstance(router, ReplayableRouter)
        assert type(router)._layerswap_original is stock_cls


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [(t, {}) for t in REPLAY_TYPES] + BRANCH_VARIANTS,
    ids=[*REPLAY_TYPES, *(f"{t}-{'-'.join(o)}" for t, o in BRANCH_VARIANTS)],
)
def test_replay_with_unchanged_weights_reproduces_stock_exactly(model_type, overrides):
    stock, replayable = _stock_and_replayable(model_type, **overrides)
    input_ids = tiny_input_ids()
    with torch.no_grad():
        with record_routing(stock) as stock_routing:
            expected = text_logits(stock, input_ids)
        with record_routing(replayable) as recorded:
            unreplayed = text_logits(replayable, input_ids)
        with replay_routing(replayable, recorded.selected_experts):
            replayed = text_logits(replayable, input_ids)
    assert torch.equal(unreplayed, expected), "with no replay set the router must be exactly stock"
    for ours, theirs in zip(recorded.selected_experts, stock_routing.selected_experts, strict=True):
        assert torch.equal(ours, theirs)
    assert torch.equal(replayed, expected)


@pytest.mark.parametrize("model_type", REPLAY_TYPES)
def test_replay_keeps_the_recorded_path_after_perturbing_the_router_and_trains_it(model_type):
    _, model = _stock_and_replayable(model_type, **TRAINING_OVERRIDES.get(model_type, {}))
    model = getattr(model, "thinker", model)  # an omni model's top-level class only generates
    input_ids = tiny_input_ids()
    with torch.no_grad(), record_routing(model) as recorded:
        model(input_ids)
    with torch.no_grad():
        for parameter in _trainable_router_parameters(model):
            parameter.add_(torch.randn_like(parameter))
        with record_routing(model) as free:
            model(input_ids)
    assert any(
        not torch.equal(a, b) for a, b in zip(free.selected_experts, recorded.selected_experts, strict=True)
    ), "the perturbation should change the router's own choice, or this test proves nothing"

    with replay_routing(model, recorded.selected_experts), record_routing(model) as replayed:
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
    for ours, theirs in zip(replayed.selected_experts, recorded.selected_experts, strict=True):
        assert torch.equal(ours, theirs)
    parameters = _trainable_router_parameters(model)
    assert parameters
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in parameters)


def test_phimoe_replays_in_training_mode_through_its_gradient_estimator():
    # Training-mode sparsemixer samples experts and uses PhimoeMultiplier; replay keeps the recorded experts.
    _, model = _stock_and_replayable("phimoe", **PHIMOE_WIDE_WINDOW)
    input_ids = tiny_input_ids()
    with torch.no_grad(), record_routing(model) as recorded:
        model(input_ids)
    model.train()
    with replay_routing(model, recorded), record_routing(model) as replayed:
        model(input_ids, labels=input_ids).loss.backward()
    for ours, theirs in zip(replayed.selected_experts, recorded.selected_experts, strict=True):
        assert torch.equal(ours, theirs)
    assert all(p.grad.abs().sum() > 0 for p in _trainable_router_parameters(model))


@pytest.mark.parametrize("family", REPLAY_FAMILIES, ids=lambda f: f.model_type)
def test_output_selected_experts_and_the_recorders_are_restored(family):
    module = importlib.import_module(family.modeling_module)
    recording = {
        cls: cls.__dict__["_can_record_outputs"]
        for cls in vars(module).values()
        if isinstance(cls, type) and isinstance(cls.__dict__.get("_can_record_outputs"), dict)
    }
    # The classes recording the family router's logits (not the talker's of an omni model, say); where the model
    # records none yet (deepseek_v3 before 5.19), the module's recording classes, to which the bundle adds the
    # router's own output.
    owners = {c: r for c, r in recording.items() if _records(r.get("router_logits"), family.router)} or {
        c: r for c, r in recording.items() if c.__module__ == module.__name__
    }
    before = {cls: dict(recorders) for cls, recorders in owners.items()}
    assert owners
    with layerswap.use_bundle(f"{family.model_type}-replay"):
        model = tiny_model(family.model_type)
        assert all("selected_experts" in cls._can_record_outputs for cls in owners)
        # The model that records: the base model, or a vision-language / omni model's text model (whose outer
        # model builds an output of its own, without the key).
        model = getattr(model, "thinker", model)
        first_router = moe_routers(model)[0][0]
        _, recording_model = max(
            (
                (name, m)
                for name, m in model.named_modules()
                if isinstance(m, tuple(owners)) and first_router.startswith(f"{name}.".lstrip("."))
            ),
            key=lambda named: len(named[0]),
        )
        input_ids = tiny_input_ids()
        with torch.no_grad(), record_routing(model) as recorded:
            output = recording_model(input_ids, output_selected_experts=True)
        assert len(output.selected_experts) == len(recorded.selected_experts)
        for captured, expected in zip(output.selected_experts, recorded.selected_experts, strict=True):
            assert torch.equal(captured, expected)
    for cls, recorders in owners.items():
        assert cls.__dict__["_can_record_outputs"] is recorders
        assert recorders == before[cls]


def _records(recorder, router_name):
    """Whether `recorder` (an OutputRecorder, a class or a class name) records the router class `router_name`."""
    target = getattr(recorder, "target_class", recorder)
    return getattr(target, "__name__", target) == router_name


# One per router parameter layout: `weight` (qwen2_moe), fp32 `weight` + correction bias (deepseek_v3), an
# nn.Linear `wg` (hunyuan_v1_moe), the router itself an nn.Linear (phimoe), an nn.Linear `gate` (afmoe).
@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3", "hunyuan_v1_moe", "phimoe", "afmoe"])
def test_from_pretrained_loads_a_stock_checkpoint_with_no_missing_keys(model_type, tmp_path):
    stock = tiny_model(model_type)
    _randomize_selection_biases(stock)
    stock.save_pretrained(tmp_path)
    with layerswap.use_bundle(f"{model_type}-replay"):
        model, info = AutoModelForCausalLM.from_pretrained(
            tmp_path,
            output_loading_info=True,
            attn_implementation="eager",  # as tiny_model builds it
        )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert all(isinstance(router, ReplayableRouter) for _, router in moe_routers(model))
    input_ids = tiny_input_ids()
    with torch.no_grad():
        assert_computed_close(text_logits(model.eval(), input_ids), text_logits(stock, input_ids))


@pytest.mark.parametrize("model_type", REPLAY_TYPES)
def test_rows_of_minus_one_take_the_live_routers_choice(model_type):
    # routing_from_vllm(prompt_start=N) leaves the N prompt rows vLLM did not return as rows of -1: the router
    # routes them itself (stock selection: correction biases, group top-k) while it replays the others.
    stock, replayable = _stock_and_replayable(model_type)
    input_ids = tiny_input_ids()
    with torch.no_grad():
        with record_routing(stock) as stock_routing:
            expected = text_logits(stock, input_ids)
        partly_live = [t.clone() for t in stock_routing.selected_experts]
        for tensor in partly_live:
            tensor[2:9] = -1
        with replay_routing(replayable, partly_live), record_routing(replayable) as replayed:
            logits = text_logits(replayable, input_ids)
    for ours, theirs in zip(replayed.selected_experts, stock_routing.selected_experts, strict=True):
        assert torch.equal(ours, theirs)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
