"""'<model_type>-quant': the family's Experts as an nn.ModuleList of plain nn.Linear experts, so bitsandbytes,
GPTQ/AWQ, torchao, quanto and HQQ quantize every expert; loads per-expert and fused checkpoints, saves the stock
layout."""

from __future__ import annotations

from ...bundle import Bundle, Family, Patch
from .conversion import linear_experts_conversions
from .modules import LinearExperts, linear_experts_adapter

__all__ = ["LinearExperts", "build", "linear_experts_adapter", "linear_experts_conversions"]


def build(family: Family) -> Bundle | None:
    if family.experts is None:
        return None
    return Bundle.for_family(
        family,
        "quant",
        (
            f"{family.experts} as an nn.ModuleList of plain nn.Linear experts, so bitsandbytes, GPTQ/AWQ, "
            "torchao, quanto and HQQ quantize every expert. Loads per-expert and fused checkpoints; saves the "
            "stock layout."
        ),
        patches=(Patch(family.modeling_module, family.experts, linear_experts_adapter(family.model_type)),),
        conversions={family.model_type: linear_experts_conversions},
    )
