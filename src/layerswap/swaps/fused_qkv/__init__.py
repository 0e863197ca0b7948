"""'<model_type>-fused_qkv': the family's attention with one fused qkv_proj in place of q_proj / k_proj / v_proj,
loading stock and fused checkpoints and saving the stock layout.

A stock tensor-parallel plan shards q_proj / k_proj / v_proj column-wise and o_proj row-wise; under the bundle
`qkv_proj` is sharded column-wise with each rank holding its own q, k and v heads, and a world size that does not
divide the heads raises FusedQKVParallelismError before any weight is loaded
(`_hf.parallel.check_tensor_parallel_plans`). device_map (accelerate's placement of whole decoder layers) is
unaffected.
"""

from __future__ import annotations

from ..._hf.parallel import check_tensor_parallel_plans
from ...bundle import Bundle, Family, Patch
from .conversion import fused_qkv_conversions
from .modules import FusedQKVAttention, fused_qkv_adapter

__all__ = ["EXCLUDED", "FusedQKVAttention", "build", "fused_qkv_adapter", "fused_qkv_conversions"]

# Families in the table whose attention does not fit FusedQKVAttention, with the reason.
EXCLUDED: dict[str, str] = {}


def serves(family: Family) -> bool:
    return family.attention is not None and family.model_type not in EXCLUDED


def build(family: Family) -> Bundle | None:
    if not serves(family):
        return None
    return Bundle.for_family(
        family,
        "fused_qkv",
        (
            f"{family.attention} with one fused qkv_proj GEMM in place of q_proj, k_proj and v_proj (GQA, biases, "
            "q/k norms and sliding windows as in stock). Loads stock and fused checkpoints; saves the stock "
            "layout. Tensor parallelism shards qkv_proj head-wise."
        ),
        patches=(Patch(family.modeling_module, family.attention, fused_qkv_adapter),),
        conversions={family.model_type: fused_qkv_conversions},
        installers=(check_tensor_parallel_plans,),
        needs=("fused_qkv",),
    )
