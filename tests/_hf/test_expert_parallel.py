"""_hf.expert_parallel on one process: the dispatch wrapper that lets '-quant' experts split themselves, the load
report, and the gathered save's failure reporting without a process group. The sharded loads and saves run on two
ranks in tests/test_distributed.py."""

from types import SimpleNamespace

import pytest
import torch

from _support.global_state import assert_wrapper_shared_and_restored
from layerswap._hf import expert_parallel

expert_parallel_module = pytest.importorskip("transformers.distributed.expert_parallel")


def test_the_expert_parallel_dispatch_wrapper_is_shared_and_restored_exactly():
    assert_wrapper_shared_and_restored(
        expert_parallel_module.EpDispatchExpertsParallel,
        "install_forward",
        ("qwen3_moe-quant", "mixtral-quant"),
    )


def test_the_dispatch_splits_experts_that_split_themselves_first():
    calls = []

    class Splits(torch.nn.Module):
        def _layerswap_shard_experts(self, rank, size):
            calls.append(("split", rank, size))

    class Mesh:
        def get_local_rank(self):
            return 1

        def size(self):
            return 2

    def stock(self, module, ep_mesh, *, tp_mesh, ep_implementation="auto"):
        calls.append(("install", tp_mesh, ep_implementation))

    install_forward = expert_parallel._splitting_first(stock)
    install_forward(None, Splits(), ep_mesh=Mesh(), tp_mesh="tp")
    install_forward(None, torch.nn.Linear(1, 1), ep_mesh=Mesh(), tp_mesh="tp")  # stock experts: as they are
    assert calls == [("split", 1, 2), ("install", "tp", "auto"), ("install", "tp", "auto")]


def test_checkpoint_tensors_of_experts_other_ranks_hold_are_not_unexpected():
    class Held(torch.nn.Module):
        _layerswap_held_experts = range(2, 4)
        num_global_experts = 4

    info = SimpleNamespace(
        unexpected_keys={
            "m.experts.0.w1.weight",
            "m.experts.3.w1.weight",  # held here: loaded, would not be unexpected; kept if it were
            "m.experts.10.w1.weight",  # no such expert: really unexpected
            "m.other.weight",
        }
    )
    expert_parallel.forget_keys_held_elsewhere([("m.experts", Held())], info)
    assert info.unexpected_keys == {"m.experts.3.w1.weight", "m.experts.10.w1.weight", "m.other.weight"}


def test_a_model_without_experts_split_by_expert_gathers_nothing():
    # No collective runs (none could here, without a process group): the state dict comes back as it was.
    state = {"weight": torch.zeros(1)}
    assert expert_parallel.gather_held_experts(torch.nn.Linear(1, 1), state, keep=True) is state
