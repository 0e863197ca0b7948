"""Tensor-parallel plans that describe the modules a bundle swapped in.

A model's `tp_plan` comes from its config and classes, which name the stock modules: `mlp.experts.gate_up_proj`
(`packed_colwise`), `mlp.experts.down_proj` (`rowwise`), `mlp.experts` (`moe_tp_experts`, which sums the experts'
partial outputs), and `self_attn.q_proj` / `k_proj` / `v_proj`. After a swap those names match nothing, and
tensor parallelism would shard nothing there, or fail. This rewrites the plans of a freshly built swapped model:

- LinearExperts (the '-quant' bundles): each expert is a plain MLP, sharded as a dense one is: gate and up
  `colwise`, down `rowwise` (which sums the partial outputs itself, so the module-level `moe_tp_experts` entry
  goes: it would sum them a second time).
- FusedQKVAttention ('-fused_qkv', '-fast'): the q/k/v entries go (a fused q|k|v cannot take a column split; the
  other entries stay, and resolving a plan that shards anything inside a fused attention still raises
  FusedQKVParallelismError).
- Any other entry under a swapped module that matches nothing in the model goes; every other entry stays.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn


def rewrite_tp_plans(model: nn.Module) -> None:
    """Rewrite the `_tp_plan` of `model` and of every PreTrainedModel inside it for the modules swapped in."""
    from transformers.modeling_utils import PreTrainedModel

    for submodel in model.modules():
        plan = getattr(submodel, "_tp_plan", None)
        if isinstance(submodel, PreTrainedModel) and isinstance(plan, dict) and plan:
            submodel._tp_plan = _rewritten(submodel, plan)


def _generic(name: str) -> str:
    # As transformers matches plan entries: layer (and expert) numbers become '*'.
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def _rewritten(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    from .adapters.attention import FusedQKVAttention
    from .adapters.experts import LinearExperts

    swapped: dict[str, type] = {}
    for name, module in model.named_modules():
        if hasattr(type(module), "_layerswap_original"):
            swapped.setdefault(_generic(name), type(module))
    if not swapped:
        return plan
    names = {_generic(n) for n, _ in model.named_modules()} | {
        _generic(n) for n, _ in model.named_parameters()
    }
    rewritten: dict[str, str] = {}
    for key, style in plan.items():
        owner = next((path for path in swapped if key == path or key.startswith(path + ".")), None)
        if owner is None:
            rewritten[key] = style
            continue
        cls: Any = swapped[owner]
        leaf = key[len(owner) + 1 :]
        if issubclass(cls, LinearExperts):
            expert = cls.expert_names
            if leaf == "gate_up_proj":
                rewritten[f"{owner}.*.{expert.gate}"] = "colwise"
                rewritten[f"{owner}.*.{expert.up}"] = "colwise"
                continue
            if leaf == "down_proj":
                rewritten[f"{owner}.*.{expert.down}"] = "rowwise"
                continue
            if not leaf:
                continue  # moe_tp_experts: the rowwise down projections sum the partial outputs already
        if issubclass(cls, FusedQKVAttention) and leaf in ("q_proj", "k_proj", "v_proj"):
            continue
        if key in names or f"{key}.weight" in names:
            rewritten[key] = style
    return rewritten
