"""Tensor parallelism: plans that describe the modules a bundle swapped in, and the guard that refuses plans
sharding what cannot be sharded.

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

A swapped class says what its entries become through `_layerswap_tp_plan(owner, leaf, style)`: the entries that
replace the stock entry `owner.leaf` (an empty dict drops it), or None for the rule above. A class that cannot be
sharded at all sets `_layerswap_unshardable` (a message naming the fix), and `refuse_tensor_parallelism` (an
installer) makes resolving a plan that shards inside one raise FusedQKVParallelismError.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from torch import nn

from ..errors import FusedQKVParallelismError, UnsupportedTransformersError
from .active import is_swapped
from .compat import unsupported_reason
from .journal import Journal


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
    swapped: dict[str, type] = {}
    for name, module in model.named_modules():
        if is_swapped(module):
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
        rule = getattr(swapped[owner], "_layerswap_tp_plan", None)
        replaced = rule(owner, key[len(owner) + 1 :], style) if rule is not None else None
        if replaced is not None:
            rewritten.update(replaced)
        elif key in names or f"{key}.weight" in names:
            rewritten[key] = style
    return rewritten


# --- refusing plans that shard inside an unshardable module ------------------------------------------------

_ATTRIBUTE = "_resolve_parallel_plans"
_guard = Journal()
_guard_users = 0


def _distributed_mixin() -> type:
    # enable_bundle refuses first (compat.refuse_unsupported); this guards a direct call.
    reason = unsupported_reason("fused_qkv")
    if reason is not None:
        raise UnsupportedTransformersError(f"{reason}.")
    from transformers.distributed.mixin import DistributedMixin

    return DistributedMixin


def refuse_tensor_parallelism(options: Any) -> Callable[[], None]:
    """Installer: wrap DistributedMixin._resolve_parallel_plans with the unshardable-module check. Every bundle
    that installs it shares one wrapper: the first one in wraps, the last one out puts back."""
    global _guard_users
    mixin = _distributed_mixin()
    if _guard_users == 0:
        _guard.set_attribute(mixin, _ATTRIBUTE, _guarded(mixin.__dict__[_ATTRIBUTE]))
    _guard_users += 1
    restored = False

    def restore() -> None:
        global _guard_users
        nonlocal restored
        if restored:
            return
        restored = True
        _guard_users -= 1
        if _guard_users == 0:
            _guard.undo()

    return restore


def _guarded(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _resolve_parallel_plans(self: nn.Module, distributed_config: Any) -> Any:
        plans = original(self, distributed_config)
        refuse_plan_through_unshardable(self, plans[0])
        return plans

    return _resolve_parallel_plans


def refuse_plan_through_unshardable(model: nn.Module, tp_plan: dict[str, str]) -> None:
    """Raise if the resolved (layer-numbered) tensor-parallel plan shards anything inside an unshardable module."""
    unshardable = [
        (name, module)
        for name, module in model.named_modules()
        if getattr(type(module), "_layerswap_unshardable", None)
    ]
    if not unshardable or not tp_plan:
        return
    for name, module in unshardable:
        touched = sorted(rule for rule in tp_plan if rule == name or rule.startswith(name + "."))
        if touched:
            model_type = getattr(getattr(model, "config", None), "model_type", "<model_type>")
            raise FusedQKVParallelismError(
                f"Tensor parallelism would shard {touched[0]} ({tp_plan[touched[0]]}) inside {name}: "
                + type(module)._layerswap_unshardable.format(model_type=model_type)
            )
