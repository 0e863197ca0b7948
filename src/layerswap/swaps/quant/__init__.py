"""'<model_type>-quant': the family's Experts as an nn.ModuleList of plain nn.Linear experts, so bitsandbytes,
GPTQ/AWQ, torchao, quanto and HQQ quantize every expert; loads per-expert and fused checkpoints, saves the stock
layout."""

from __future__ import annotations

import functools

from ..._hf.expert_parallel import shard_experts_on_dispatch
from ..._hf.parallel import check_expert_parallel_plans, read_fused_sources_whole
from ...bundle import Bundle, Family, Patch
from .conversion import linear_experts_conversions, parallel_experts_conversions
from .modules import LinearExperts, linear_experts_adapter

__all__ = ["LinearExperts", "build", "linear_experts_adapter", "linear_experts_conversions"]


# Experts classes whose checkpoints store each projection of every expert in a module of its own (the family row's
# tensors name those modules' weights), in the MoE MLP and the mixture-of-attention alike.
_PER_PROJECTION_MODULES = frozenset({"JetMoeParallelExperts"})


def build(family: Family) -> Bundle | None:
    if family.experts is None:
        return None
    adapter = linear_experts_adapter(f"{family.model_type}-quant", family.conversion_keys, family.flags)
    if family.experts in _PER_PROJECTION_MODULES:
        leaves = tuple(t.name.removesuffix(".weight") for t in family.fused_tensors)
        edit = functools.partial(parallel_experts_conversions, leaves=leaves)
    else:
        edit = functools.partial(
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
        installers=(read_fused_sources_whole, check_expert_parallel_plans, shard_experts_on_dispatch),
    )
