"""Single-threaded worker threads that run disjoint experts side by side (CPU, no autograd).

Why: an MoE layer on a CPU runs dozens of small GEMMs (1-35 rows per expert). Split over the intra-op threads,
each one pays a fork/join, and on a 2-core machine torch's bf16 GEMM at these shapes scales badly with threads;
giving each core whole experts instead keeps every core streaming weights with no synchronisation between
GEMMs. torch releases the GIL inside its ops, so Python threads run the kernels concurrently.

Each worker sets its own intra-op thread count to 1 (OpenMP's and MKL's per-thread settings), which leaves the
calling thread's count as it was; the process-wide default that later threads start from is restored once the
workers exist. Whether this beats the other strategies is measured per machine (`cpu_dispatch`), never assumed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

_T = TypeVar("_T")

_lock = threading.Lock()
_pools: dict[
    tuple[int, int], ThreadPoolExecutor
] = {}  # (pid, workers) -> pool; a forked child builds its own


def _single_threaded(started: threading.Barrier) -> None:
    torch.get_num_threads()  # torch's lazy per-thread init first, so that it cannot undo the next line later
    torch.set_num_threads(1)
    started.wait()


def pool(workers: int) -> ThreadPoolExecutor:
    """The process's pool of `workers` single-threaded worker threads, started on first use."""
    key = (os.getpid(), workers)
    with _lock:
        executor = _pools.get(key)
        if executor is None:
            threads_here = torch.get_num_threads()
            started = threading.Barrier(workers + 1)
            executor = ThreadPoolExecutor(workers, thread_name_prefix="layerswap-experts")
            for _ in range(workers):  # one task each, all waiting on the barrier: every thread gets started
                executor.submit(_single_threaded, started)
            started.wait()
            # set_num_threads(1) in a worker also set the default that threads started later begin with
            torch.set_num_threads(threads_here)
            _pools[key] = executor
        return executor


def balanced_groups(items: Sequence[int], costs: Sequence[float], groups: int) -> list[list[int]]:
    """`items` split into `groups` lists of about equal total cost (greedy, costliest first)."""
    buckets: list[list[int]] = [[] for _ in range(groups)]
    loads = [0.0] * groups
    for item, cost in sorted(zip(items, costs, strict=True), key=lambda pair: -pair[1]):
        lightest = loads.index(min(loads))
        buckets[lightest].append(item)
        loads[lightest] += cost
    return [bucket for bucket in buckets if bucket]


def run_split(work: Callable[[list[int]], _T], groups: list[list[int]], workers: int) -> list[_T]:
    """`work(group)` for every group, on the worker threads, under the caller's grad and inference modes (both
    are per thread: a worker would otherwise record autograd graphs, or refuse to write the caller's inference
    tensors); the first error is raised here."""
    if len(groups) <= 1:
        return [work(group) for group in groups]
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def in_callers_modes(group: list[int]) -> _T:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return work(group)

    return list(pool(workers).map(in_callers_modes, groups))
