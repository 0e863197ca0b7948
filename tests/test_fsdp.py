"""One FSDP2 training step on two CPU ranks (gloo) with '-quant' experts and '-replay' routers, replaying a recorded
routing that differs from what the routers would pick, training every parameter or LoRA adapters (peft) on the
expert Linears: the loss and every gradient equal the one-process step's, the routers (or adapters) get
gradients, and every rank's routers follow the replayed routing."""

from __future__ import annotations

import pytest
import torch

import layerswap
from _support.checkpoints import checkpoint_factory
from _support.distributed import (
    WORLD_SIZE,
    distributed_available,
    run_on_ranks,
    train_step_on_ranks,
    with_lora,
)
from _support.tiny_models import auto_class, tiny_input_ids

pytestmark = pytest.mark.skipif(not distributed_available(), reason="torch without gloo")

MODEL_TYPE = "qwen3_moe"
BUNDLES = (f"{MODEL_TYPE}-quant", f"{MODEL_TYPE}-replay")
# fp32 sums in another order (FSDP averages the two ranks' identical gradients).
TOLERANCE = {"atol": 1e-6, "rtol": 1e-5}


# LoRA on every expert's projections (and nowhere else: qwen3_moe's attention has no such names).
LORA_TARGETS = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", params=[None, LORA_TARGETS], ids=["full", "lora"])
def steps(request, tmp_path_factory):
    """(one-process step, the 2-rank step's folder, the replayed routing), training every parameter or, with LoRA,
    the adapters on the expert Linears."""
    lora = request.param
    if lora is not None:
        pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("fsdp")
    path = str(checkpoint_factory(tmp_path_factory)(MODEL_TYPE))
    input_ids = tiny_input_ids()
    with layerswap.use_bundle(*BUNDLES):
        model = auto_class(MODEL_TYPE).from_pretrained(path)
        if lora is not None:
            model = with_lora(model, lora)
        with torch.no_grad(), layerswap.record_routing(model) as live:
            model(input_ids)
        # Every token to the next experts over: a routing the routers would not pick.
        experts = model.config.num_experts
        routing = [(selected + 1) % experts for selected in live.selected_experts]
        with layerswap.replay_routing(model, routing):
            loss = model(input_ids, labels=input_ids).loss
        loss.backward()
    expected = {
        "loss": loss.detach(),
        "gradients": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
    }
    run_on_ranks(
        train_step_on_ranks, MODEL_TYPE, path, BUNDLES, routing, input_ids, str(root), lora, timeout_s=240
    )
    return expected, root, routing


def test_the_model_is_sharded(steps):
    _, root, _ = steps
    sharded = torch.load(root / "train.pt")["sharded"]
    assert any(".mlp.experts.0.gate_proj.weight" in name for name in sharded), sharded[:5]


def test_loss_and_gradients_match_one_process(steps):
    expected, root, _ = steps
    got = torch.load(root / "train.pt")
    torch.testing.assert_close(got["loss"], expected["loss"], **TOLERANCE)
    # Experts no token reached have no gradient, in either run.
    assert got["gradients"].keys() == expected["gradients"].keys()
    for name, gradient in expected["gradients"].items():
        torch.testing.assert_close(got["gradients"][name], gradient, **TOLERANCE, msg=name)


def test_routers_or_adapters_get_gradients(steps):
    _, root, _ = steps
    gradients = torch.load(root / "train.pt")["gradients"]
    if any("lora_" in name for name in gradients):
        # peft froze the base model: only the adapters train, every expert a token reached has them.
        assert all("lora_" in name for name in gradients)
        assert any(".experts.0.gate_proj.lora_A" in name for name in gradients), sorted(gradients)[:4]
    else:
        routers = {n: g for n, g in gradients.items() if ".mlp.gate." in n}
        assert routers and all(g.abs().sum() > 0 for g in routers.values()), sorted(routers)


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_every_rank_follows_the_replayed_routing(steps, rank):
    _, root, routing = steps
    followed = torch.load(root / f"routing-{rank}.pt")
    assert len(followed) == len(routing)
    assert all(torch.equal(f, r) for f, r in zip(followed, routing, strict=True))
