"""The single-threaded expert workers: one thread each, the caller's thread count untouched, even splits."""

from __future__ import annotations

import threading

import pytest
import torch

from layerswap.kernels import _workers


def test_workers_are_single_threaded_and_leave_the_caller_and_new_threads_alone() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        counts = _workers.run_split(lambda group: torch.get_num_threads(), [[0], [1], [2]], workers=2)
        assert counts == [1, 1, 1]
        assert torch.get_num_threads() == 2
        started_later = []
        thread = threading.Thread(target=lambda: started_later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert started_later == [2]
    finally:
        torch.set_num_threads(threads)


def test_one_group_runs_in_the_calling_thread() -> None:
    caller = threading.get_ident()
    assert _workers.run_split(lambda group: threading.get_ident(), [[0, 1]], workers=2) == [caller]


def test_a_worker_error_reaches_the_caller() -> None:
    def work(group):
        if group == [1]:
            raise RuntimeError("expert 1 failed")
        return group

    with pytest.raises(RuntimeError, match="expert 1 failed"):
        _workers.run_split(work, [[0], [1]], workers=2)


def test_balanced_groups_split_the_cost_evenly() -> None:
    groups = _workers.balanced_groups([0, 1, 2, 3, 4], [5.0, 1.0, 1.0, 2.0, 1.0], groups=2)
    assert sorted(item for group in groups for item in group) == [0, 1, 2, 3, 4]
    assert sorted(sum([5.0, 1.0, 1.0, 2.0, 1.0][i] for i in group) for group in groups) == [5.0, 5.0]
    assert _workers.balanced_groups([7], [1.0], groups=4) == [[7]]  # no empty groups


# A model's weights require grad; under no_grad or inference_mode (per thread) the workers must run as the caller.
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_workers_run_under_the_callers_grad_mode(mode: str) -> None:
    from layerswap.kernels import fused_moe_reference

    generator = torch.Generator().manual_seed(0)
    gate_up = torch.nn.Parameter(torch.randn(8, 32, 16, generator=generator))
    down = torch.nn.Parameter(torch.randn(8, 16, 16, generator=generator))
    x = torch.randn(20, 16, generator=generator)
    index = torch.rand(20, 8, generator=generator).topk(2, dim=-1).indices
    weights = torch.rand(20, 2, generator=generator)
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        want = fused_moe_reference(x, gate_up, down, index, weights, ops=("row",) * 7)
        got = fused_moe_reference(x, gate_up, down, index, weights, ops=("row",) * 7, workers=2)
    assert not got.requires_grad
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
