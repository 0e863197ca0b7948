"""Swapped modules on two CPU ranks (gloo): tensor parallelism (`tp_plan="auto"`) against one process.

One world of two spawned ranks runs every sharded load of this module (`_support.distributed`); the reference
logits come from the same checkpoints loaded in this process. docs/distributed.md lists what these tests cover.
"""

from __future__ import annotations

import pytest
import torch

from _support.checkpoints import read_checkpoint
from _support.distributed import Load, distributed_available, load_on_ranks, run_on_ranks
from _support.tiny_models import auto_class, text_logits, tiny_input_ids, tiny_model

pytestmark = pytest.mark.skipif(not distributed_available(), reason="torch without gloo")

# qwen3_moe: stock per-expert names (gate_proj/up_proj/down_proj); mixtral: renamed ones (w1/w3/w2) under
# block_sparse_moe. Both with GQA attention and a stock tensor-parallel plan.
MODEL_TYPES = ("qwen3_moe", "mixtral")
# Per-expert checkpoints are what save_pretrained writes by default; fused ones (`experts.gate_up_proj [E, 2I, H]`)
# what save_original_format=False writes, and v5-native checkpoints hold.
LAYOUTS = ("per_expert", "fused")
# fp32 logits of two sums in another order: stock sharded against one process differs by about 2e-7.
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Every sharded load's logits (or error), the one-process logits and the checkpoints, by name."""
    root = tmp_path_factory.mktemp("distributed")
    input_ids = tiny_input_ids()
    checkpoints, expected, originals = {}, {}, {}
    loads = []
    for model_type in MODEL_TYPES:
        model = tiny_model(model_type)
        originals[model_type] = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            expected[model_type] = text_logits(model, input_ids)
        for layout in LAYOUTS:
            path = root / f"{model_type}-{layout}"
            model.save_pretrained(path, save_original_format=layout == "per_expert")
            checkpoints[model_type, layout] = path
            loads.append(Load(f"stock-{model_type}-{layout}", model_type, str(path)))
            loads.append(
                Load(
                    f"quant-{model_type}-{layout}", model_type, str(path), (f"{model_type}-quant",), save=True
                )
            )
    run_on_ranks(load_on_ranks, loads, input_ids, str(root), timeout_s=300)
    return root, expected, originals, checkpoints


def _result(root, name):
    error = root / f"{name}.error"
    assert not error.exists(), error.read_text()
    return torch.load(root / f"{name}.pt")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_stock_tensor_parallel_matches_one_process(sharded, model_type, layout):
    # The baseline the bundles are held to: stock transformers' own tensor parallelism on CPU.
    root, expected, _, _ = sharded
    torch.testing.assert_close(
        _result(root, f"stock-{model_type}-{layout}"), expected[model_type], **TOLERANCE
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_quant_tensor_parallel_matches_one_process(sharded, model_type, layout):
    # Fused checkpoints used to be cut along the experts axis (by the rules of one expert's 2D weight) before the
    # split: the load failed with CheckpointShapeError. Each rank now gets its half of every expert.
    root, expected, _, _ = sharded
    torch.testing.assert_close(
        _result(root, f"quant-{model_type}-{layout}"), expected[model_type], **TOLERANCE
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_save_from_the_sharded_quant_model_reloads_in_stock_transformers_bitwise(
    sharded, model_type, layout
):
    root, _, originals, checkpoints = sharded
    _result(root, f"quant-{model_type}-{layout}")
    saved = root / f"quant-{model_type}-{layout}-saved"
    if layout == "per_expert":
        # Same keys, same bytes as the checkpoint it came from (as the one-process save test asks).
        ours, original = read_checkpoint(saved), read_checkpoint(checkpoints[model_type, layout])
        assert ours.keys() == original.keys()
        assert all(torch.equal(ours[k], original[k]) for k in ours)
    reloaded, info = auto_class(model_type).from_pretrained(saved, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    state = reloaded.state_dict()
    assert state.keys() == originals[model_type].keys()
    assert all(torch.equal(state[k], originals[model_type][k]) for k in state)
