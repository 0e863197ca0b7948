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
