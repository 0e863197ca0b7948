"""auto-round RTN W4A16 (iters=0) over tiny MoE models loaded under '<family>-quant', saved in its own format
(auto_round: GPTQ-style qweight/qzeros/scales per layer), then reloaded.

auto-round 0.16 splits stock fused experts itself when it loads such a checkpoint without the bundle, under the
stock per-expert names (`experts.N.gate_proj`); mixtral's per-expert names are `w1`/`w3`/`w2`, which a save under
the bundle writes, as mixtral's stock checkpoints have them.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import layerswap
from auto_round import AutoRound
from layerswap.errors import CheckpointNeedsBundleError, LayerswapWarning
from tiny_checkpoints import logits

# RTN 4-bit (auto-round computes in float16) of tiny random weights: measured up to 0.19 of the logits' range.
MAX_RELATIVE_LOGIT_ERROR = 0.3


@pytest.fixture(scope="module")
def rtn_checkpoint(tiny_checkpoint, tmp_path_factory):
    """(model type, unquantized logits, the auto_round checkpoint) of a bundle model quantized with RTN."""
    model_type, path = tiny_checkpoint
    with layerswap.use_bundle(f"{model_type}-quant"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = logits(model)
    rounder = AutoRound(
        model,
        AutoTokenizer.from_pretrained(path),
        scheme="W4A16",
        group_size=128,
        iters=0,  # RTN
        disable_opt_rtn=True,  # plain round-to-nearest, no calibration data
        dataset=[
            "t1 t2 t3 t4 t5 t6 t7 t8"
        ],  # never read by RTN, but the default would be fetched from the hub
        seqlen=8,
        nsamples=1,
    )
    out = tmp_path_factory.mktemp(f"{model_type}-rtn")
    rounder.quantize_and_save(str(out), format="auto_round")
    (saved,) = {p.parent for p in out.rglob("config.json")}  # auto-round writes into a subfolder it names
    return model_type, expected, saved


def test_rtn_saves_every_expert_projection_quantized(rtn_checkpoint):
    _, _, saved = rtn_checkpoint
    assert (
        json.loads((saved / "config.json").read_text())["quantization_config"]["quant_method"] == "auto-round"
    )
    keys = [key for file in saved.glob("*.safetensors") for key in safe_open(file, "pt").keys()]  # noqa: SIM118
    assert sum(".experts." in key and key.endswith(".qweight") for key in keys) == 2 * 8 * 3


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def test_layerswap_from_pretrained_reloads_it_close_to_the_unquantized_model(rtn_checkpoint):
    model_type, expected, saved = rtn_checkpoint
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LayerswapWarning)
        model = layerswap.from_pretrained(AutoModelForCausalLM, saved)
    ours = [str(w.message) for w in caught if issubclass(w.category, LayerswapWarning)]
    # auto-round 0.16 replaces some families' MoE blocks itself as it loads (qwen3_moe: its
    # LinearQwen3MoeSparseMoeBlock), before the bundle can swap the experts: layerswap says so, naming it.
    assert all("another tool replaced" in message and "auto_round" in message for message in ours), ours
    assert _relative_error(logits(model), expected) < MAX_RELATIVE_LOGIT_ERROR
    if ours:
        print(f"{model_type}: {ours[0]}")


def test_a_load_without_the_bundle_is_right_or_refused(rtn_checkpoint):
    # Never silently wrong: where auto-round's own loading cannot place the experts (mixtral's w1/w3/w2), the
    # load must be refused, naming the bundle.
    model_type, expected, saved = rtn_checkpoint
    try:
        model = AutoModelForCausalLM.from_pretrained(saved)
    except CheckpointNeedsBundleError as error:
        assert f"{model_type}-quant" in str(error)
        return
    assert _relative_error(logits(model), expected) < MAX_RELATIVE_LOGIT_ERROR
