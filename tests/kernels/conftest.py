"""Run the Triton kernels in Triton's interpreter when there is no GPU.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when layerswap.kernels._triton_fused_moe is
first imported; pytest loads this file before it imports the tests here, which import that module. (triton
itself is already imported by then, through transformers; the kernels avoid triton's own @jit helpers such as
tl.zeros, which were built before the variable was set.) On a CUDA machine the variable is left alone, so the
compiled kernels are what gets tested (benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
