"""Run the Triton kernels in Triton's interpreter when there is no GPU.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when layerswap.kernels.triton_moe is
first imported; pytest loads this file before it imports the tests here, which import that module. (triton
itself is already imported by then, through transformers; the kernels avoid triton's own @jit helpers such as
tl.zeros, which were built before the variable was set.) On a CUDA machine the variable is left alone, so the
compiled kernels are what gets tested (benchmarks/gpu_check.sh).

tests/conftest.py turns CPU-dispatch calibration off for the suite; the tests here that turn it on cache
under a temp dir (below), never under the real ~/.cache/layerswap.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _calibration_cache_in_a_temp_dir(tmp_path_factory: pytest.TempPathFactory):
    """Any CPU-dispatch calibration a test here runs caches under a temp dir, never ~/.cache/layerswap."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAYERSWAP_CACHE_DIR", str(tmp_path_factory.mktemp("layerswap-cache")))
        yield
