"""Fused MoE kernels: Triton on CUDA, plain PyTorch elsewhere. Importing this never needs triton."""

from __future__ import annotations

from ._cpu_strategies import Plan
from .configs import KernelInputError, TileConfig
from .cpu_dispatch import CpuInfo, cpu_info, plan_for
from .dispatch import fused_moe
from .torch_moe import fused_moe_reference

__all__ = [
    "CpuInfo",
    "KernelInputError",
    "Plan",
    "TileConfig",
    "cpu_info",
    "fused_moe",
    "fused_moe_reference",
    "plan_for",
]
