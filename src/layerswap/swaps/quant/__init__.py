"""'<model_type>-quant': the family's Experts as an nn.ModuleList of plain nn.Linear experts, so bitsandbytes,
GPTQ/AWQ, torchao, quanto and HQQ quantize every expert; loads per-expert and fused checkpoints, saves the stock
layout."""

from __future__ import annotations

import functools

from ..._hf.parallel import read_fused_sources_whole
from ...bundle import Bundle, Family, Patch
from .conversion import linear_experts_conversions, parallel_experts_conversions
from .modules import LinearExperts, linear_experts_adapter

__all__ = ["LinearExperts", "build", "linear_experts_adapter", "linear_experts_conversions"]


# Experts classes whose checkpoints store each projection in a module of its own, by stock class name: the module
# names, in the MoE MLP and in the mixture-of-attention alike.
_OWN_CONVERSIONS = {
    "JetMoeParallelExperts": functools.partial(
        parallel_experts_conversions, leaves=("input_linear", "output_linear")
    ),
}


def build(family: Family) -> Bundle | None:
    if family.experts is None:
        return None
    adapter = linear_experts_adapter(f"{family.model_type}-quant", family.conversion_keys, family.flags)
    edit = _OWN_CONVERSIONS.get(family.experts) or functools.partial(
        linear_experts_conversions, family_types=family.conversion_keys, tensors=family.fused_tensors
    )
    return Bundle.for_family(
        family,
        "quant",
        (
            f"{' and '.join(family.all_experts)} as an nn.ModuleList of plain nn.Linear experts, so bitsandbytes, "
            "GPTQ/AWQ, torchao, quanto and HQQ quantize every expert. Loads per-expert and fused checkpoints; "
            "saves the stock layout."
        ),
        patches=tuple(Patch(family.modeling_module, experts, adapter) for experts in family.all_experts),
        conversions=dict.fromkeys(family.conversion_keys, edit),
        installers=(read_fused_sources_whole,),
    )
