"""Fused MoE kernels: Triton on CUDA, plain PyTorch elsewhere. Importing this never needs triton."""

from __future__ import annotations

from .fused_moe import KernelInputError, TileConfig, fused_moe
from .reference import fused_moe_reference

__all__ = ["KernelInputError", "TileConfig", "fused_moe", "fused_moe_reference"]
