"""'<model_type>-fast': the family's Experts computed by a fused-MoE kernel (Triton on CUDA, the fast PyTorch
path elsewhere) with the stock weights and checkpoints, plus fused-QKV attention where the family has a
'-fused_qkv' swap."""

from __future__ import annotations

from transformers.core_model_loading import WeightTransform

from ..._hf.parallel import check_expert_parallel_plans, check_tensor_parallel_plans
from ...bundle import Bundle, BundleOptions, Family, Patch
from .. import fused_qkv
from .conversion import shape_checked_expert_merges
from .modules import (
    BACKEND_NAME,
    FusedExpertsForwardMixin,
    fused_experts_adapter,
    fused_experts_forward,
    register_experts_backend,
    unregister_experts_backend,
)

__all__ = [
    "BACKEND_NAME",
    "FusedExpertsForwardMixin",
    "build",
    "fused_experts_adapter",
    "fused_experts_forward",
    "register_experts_backend",
    "unregister_experts_backend",
]


def _fast_conversions(stock: list[WeightTransform], options: BundleOptions) -> list[WeightTransform]:
    return fused_qkv.fused_qkv_conversions(shape_checked_expert_merges(stock, options), options)


def build(family: Family) -> Bundle | None:
    # The kernels compute act(gate) * up on the stock fused layout only.
    if family.experts is None or family.own_gate or not family.is_stock_layout:
        return None
    patches = [
        Patch(family.modeling_module, experts, fused_experts_adapter) for experts in family.all_experts
    ]
    conversions = dict.fromkeys(family.conversion_keys, shape_checked_expert_merges)
    fused_attention = fused_qkv.serves(family)
    if fused_attention:
        patches.append(Patch(family.modeling_module, family.attention, fused_qkv.fused_qkv_adapter))
        conversions[family.model_type] = _fast_conversions
    return Bundle.for_family(
        family,
        "fast",
        (
            f"{' and '.join(family.all_experts)} computed by a fused-MoE kernel (Triton on CUDA, a sorted grouped PyTorch path "
            "elsewhere), stock weights and checkpoints"
            + (f", plus {family.attention} with one fused qkv_proj." if fused_attention else ".")
        ),
        patches=tuple(patches),
        conversions=conversions,
        installers=(check_tensor_parallel_plans,) if fused_attention else (check_expert_parallel_plans,),
        needs=("fused_qkv",) if fused_attention else (),
    )
