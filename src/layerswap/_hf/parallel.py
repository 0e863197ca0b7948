"""Tensor and expert parallelism: plans that describe the modules a bundle swapped in, and the guard that refuses
plans sharding what cannot be sharded.

A model's `tp_plan` comes from its config and classes, which name the stock modules: `mlp.experts.gate_up_proj`
(`packed_colwise`), `mlp.experts.down_proj` (`rowwise`), `mlp.experts` (`moe_tp_experts`, which sums the experts'
partial outputs), and `self_attn.q_proj` / `k_proj` / `v_proj`. After a swap those names match nothing, and
tensor parallelism would shard nothing there, or fail. This rewrites the plans of a freshly built swapped model:

- LinearExperts (the '-quant' bundles): each expert is a plain MLP, sharded as a dense one is: gate and up
  `colwise`, down `rowwise` (which sums the partial outputs itself, so the module-level `moe_tp_experts` entry
  goes: it would sum them a second time).
- FusedQKVAttention ('-fused_qkv', '-fast'): the colwise q/k/v entries become one colwise `qkv_proj` entry, which
  gives each rank its own q, k and v heads (see FusedQKVAttention._layerswap_check_tensor_parallel); the
  other entries stay.
- Any other entry under a swapped module that matches nothing in the model goes; every other entry stays.

A swapped class says what its entries become through `_layerswap_tp_plan(owner, leaf, style)`: the entries that
replace the stock entry `owner.leaf` (an empty dict drops it), or None for the rule above. A class that cannot be
sharded at all sets `_layerswap_unshardable` (a message naming the fix); a module whose sharding holds only for
some sizes has `_layerswap_check_tensor_parallel(name, entries, tp_size)`, which raises where they do not fit.

The expert-parallel plan (`ep_plan`: `mlp.experts` dispatched by `ep_dispatch_experts`, its stacked 3D parameters
split by expert, `grouped_gemm`) is rewritten the same way through `_layerswap_ep_plan`: LinearExperts keeps the
dispatch entry and drops the others, as it splits itself by expert (`_hf.expert_parallel`). Every swapped experts
module the dispatch reaches must split into whole experts per rank: an expert-parallel size that does not divide
its `num_experts` is refused (ExpertParallelismError), and a module with `_layerswap_check_expert_parallel(name,
ep_size, dp_size)` refuses what else it cannot take.

`check_tensor_parallel_plans` and `check_expert_parallel_plans` (installers) run these checks when transformers
resolves the plans, before any weight is loaded.

Loading under tensor parallelism, transformers reads each checkpoint tensor already cut to this rank's shard
(`DtensorShardOperation`), cut as the first parameter the tensor's converter fills is sharded. A fused experts
tensor (`experts.gate_up_proj [E, 2I, H]`) that the '-quant' conversion splits into per-expert `[I, H]` weights
would be cut along the experts axis by the rules of one 2D weight: rank 0 would get experts 0..E/2 whole, not
every expert's half. `read_fused_sources_whole` (an installer) hands such a tensor over uncut (a checkpoint tensor
with more dimensions than the parameter it loads into can only be one that a conversion splits), and the
conversion cuts each piece it makes with `local_shard`, by that piece's own parameter.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ExpertParallelismError, FusedQKVParallelismError, UnsupportedTransformersError
from .active import is_swapped
from .compat import unsupported_reason
from .journal import Journal


def rewrite_parallel_plans(model: nn.Module) -> None:
    """Rewrite the `_tp_plan` and `_ep_plan` of `model` and of every PreTrainedModel inside it for the modules
    swapped in."""
    from transformers.modeling_utils import PreTrainedModel

    for submodel in model.modules():
        if not isinstance(submodel, PreTrainedModel):
            continue
        plan = getattr(submodel, "_tp_plan", None)
        if isinstance(plan, dict) and plan:
            submodel._tp_plan = _rewritten(submodel, plan, "_layerswap_tp_plan")
        plan = getattr(submodel, "_ep_plan", None)
        if isinstance(plan, dict) and plan:
            submodel._ep_plan = _rewritten(submodel, plan, "_layerswap_ep_plan")


def _generic(name: str) -> str:
    # As transformers matches plan entries: layer (and expert) numbers become '*'.
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def _rewritten(model: nn.Module, plan: dict[str, str], rule_name: str) -> dict[str, str]:
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
        rule = getattr(swapped[owner], rule_name, None)
        replaced = rule(owner, key[len(owner) + 1 :], style) if rule is not None else None
        if replaced is not None:
            rewritten.update(replaced)
        elif key in names or f"{key}.weight" in names:
            rewritten[key] = style
    return rewritten


class SharedWrapper:
    """One wrapper around `owner.attribute` shared by every bundle that installs it: the first one in wraps, the
    last one out puts back."""

    def __init__(self, find_owner: Callable[[], type | None], attribute: str, make: Callable) -> None:
        self.find_owner, self.attribute, self.make = find_owner, attribute, make
        self.journal = Journal()
        self.users = 0

    def install(self) -> Callable[[], None]:
        owner = self.find_owner()
        if owner is None:  # the installed transformers has nothing to wrap (see the callers)
            return lambda: None
        if self.users == 0:
            self.journal.set_attribute(owner, self.attribute, self.make(owner.__dict__[self.attribute]))
        self.users += 1
        restored = False

        def restore() -> None:
            nonlocal restored
            if restored:
                return
            restored = True
            self.users -= 1
            if self.users == 0:
                self.journal.undo()

        return restore


# --- refusing plans that shard what cannot be sharded --------------------------------------------------------


def _distributed_mixin() -> type | None:
    """transformers' DistributedMixin where it resolves parallel plans in `_resolve_parallel_plans`, else None."""
    try:
        from transformers.distributed.mixin import DistributedMixin
    except ImportError:
        return None
    return DistributedMixin if "_resolve_parallel_plans" in vars(DistributedMixin) else None


def check_tensor_parallel_plans(options: Any) -> Callable[[], None]:
    """Installer ('-fused_qkv'): wrap DistributedMixin._resolve_parallel_plans with the swapped modules' checks."""
    # enable_bundle refuses first (compat.refuse_unsupported); this guards a direct call.
    reason = unsupported_reason("fused_qkv")
    if reason is not None:
        raise UnsupportedTransformersError(f"{reason}.")
    return _plan_guard.install()


def check_expert_parallel_plans(options: Any) -> Callable[[], None]:
    """Installer ('-quant', '-fast'): the same guard, which refuses expert-parallel sizes the swapped experts cannot
    take; nothing where the installed transformers has no `_resolve_parallel_plans` to wrap (see _hf/compat.py)."""
    return _plan_guard.install()


def _guarded(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _resolve_parallel_plans(self: nn.Module, distributed_config: Any) -> Any:
        plans = original(self, distributed_config)
        tp_plan, ep_plan = plans[0], plans[1] if len(plans) > 1 else {}
        refuse_plan_through_unshardable(self, tp_plan)
        check_swapped_modules(self, tp_plan, distributed_config.tp_size)
        ep_size, dp_size = (getattr(distributed_config, f"{kind}_size", 1) for kind in ("ep", "dp"))
        check_expert_parallel(self, ep_plan, ep_size, dp_size)
        return plans

    return _resolve_parallel_plans


_plan_guard = SharedWrapper(_distributed_mixin, "_resolve_parallel_plans", _guarded)


def check_expert_parallel(model: nn.Module, ep_plan: dict[str, str], ep_size: int, dp_size: int) -> None:
    """Raise ExpertParallelismError, before any weight is loaded, where the resolved (layer-numbered)
    expert-parallel plan dispatches to a swapped experts module that cannot be split into `ep_size` parts of whole
    experts."""
    if ep_size <= 1 or not ep_plan:
        return
    for name, module in model.named_modules():
        if not is_swapped(module) or ep_plan.get(name) != "ep_dispatch_experts":
            continue
        count = getattr(module, "num_global_experts", getattr(module, "num_experts", None))
        if isinstance(count, int) and count % ep_size:
            divisors = [d for d in range(1, count + 1) if count % d == 0]
            raise ExpertParallelismError(
                f"Expert parallelism over ep_size={ep_size} ranks cannot split {name} ({type(module).__name__}, "
                f"swapped in by layerswap) into whole experts per rank: it has num_experts={count}, and "
                f"{count} % {ep_size} = {count % ep_size}. Use an ep_size that divides {count} "
                f"({', '.join(map(str, divisors))}), or tensor parallelism without ep_size (tp_plan='auto', or "
                "DistributedConfig(tp_size=N)), which splits every expert over the ranks."
            )
        check = getattr(module, "_layerswap_check_expert_parallel", None)
        if check is not None:
            check(name, ep_size, dp_size)


def check_swapped_modules(model: nn.Module, tp_plan: dict[str, str], tp_size: int) -> None:
    """Ask every module that has `_layerswap_check_tensor_parallel` whether the resolved (layer-numbered) plan's
    entries inside it can run on `tp_size` ranks; it raises where they cannot, before any weight is loaded."""
    if not tp_plan:
        return
    for name, module in model.named_modules():
        check = getattr(module, "_layerswap_check_tensor_parallel", None)
        if check is None:
            continue
        entries = {rule: style for rule, style in tp_plan.items() if rule.startswith(name + ".")}
        if entries:
            check(name, entries, tp_size)


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


# --- loading fused checkpoint tensors into per-expert parameters ------------------------------------------


def _shard_operation() -> type | None:
    try:
        from transformers.distributed.sharding_utils import DtensorShardOperation
    except ImportError:  # a transformers without shard-on-read loading (compat: a fallback row)
        return None
    return DtensorShardOperation if "shard_tensor" in vars(DtensorShardOperation) else None


def _whole_when_fused(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def shard_tensor(self: Any, source: Any, tensor_idx: int | None = None, device=None, dtype=None) -> Any:
        shape = source.shape if isinstance(source, torch.Tensor) else source.get_shape()
        if len(shape) > self.param_ndim:
            # Fused experts for per-expert weights: the conversion splits it, then cuts each piece (local_shard).
            return source[...].to(device=device, dtype=dtype)
        return original(self, source, tensor_idx=tensor_idx, device=device, dtype=dtype)

    return shard_tensor


_whole_sources = SharedWrapper(_shard_operation, "shard_tensor", _whole_when_fused)


def read_fused_sources_whole(options: Any) -> Callable[[], None]:
    """Installer: under tensor parallelism, a checkpoint tensor with more dimensions than the parameter it
    loads into (a fused experts tensor that a conversion splits) is read whole, not cut by that parameter's
    placements; the conversion cuts what it makes with `local_shard`."""
    return _whole_sources.install()


def local_shard(parameter: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`, the full value of `parameter`, cut as `parameter` is sharded (as
    transformers cuts a checkpoint tensor on read); `tensor` itself where `parameter` is not sharded."""
    if not torch.distributed.is_available():
        return tensor
    from torch.distributed.tensor import DTensor

    operation = _shard_operation()
    if operation is None or not isinstance(parameter, DTensor):
        return tensor
    return operation(parameter).shard_tensor(tensor)


def row_shards(parameter: torch.Tensor) -> int:
    """How many ranks `parameter`'s rows (dim 0) are split over: the tensor-parallel size for a colwise-sharded
    weight, 1 for one that is not sharded."""
    if not torch.distributed.is_available():
        return 1
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(parameter, DTensor):
        return 1
    shards = 1
    for mesh_dim, placement in enumerate(parameter.placements):
        if isinstance(placement, Shard) and placement.dim in (0, -parameter.ndim):
            shards *= parameter.device_mesh.size(mesh_dim)
    return shards
