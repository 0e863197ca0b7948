"""The '<model_type>-fused_qkv' bundles, and the guard that refuses tensor parallelism through fused attention.

A stock tensor-parallel plan shards q_proj / k_proj / v_proj column-wise and o_proj row-wise. A fused q|k|v
cannot take a plain column split (each rank would get a mix of query, key and value rows, not its own heads),
and transformers has no style that shards three unequal blocks of one weight separately. So while a
'-fused_qkv' bundle is enabled, resolving a tensor-parallel plan that touches a fused attention module raises
FusedQKVParallelismError. device_map (accelerate's placement of whole decoder layers) is unaffected.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from ._bundle import Bundle, BundleOptions, Patch
from ._compat import unsupported_reason
from ._errors import FusedQKVParallelismError, UnsupportedTransformersError
from .adapters.attention import FusedQKVAttention, fused_qkv_adapter
from .conversions.qkv import fused_qkv_conversions

if TYPE_CHECKING:
    from .catalog import Family

# Families in the table whose attention does not fit FusedQKVAttention, with the reason.
EXCLUDED: dict[str, str] = {}


def fused_qkv_bundle(family: Family) -> Bundle | None:
    if family.attention is None or family.model_type in EXCLUDED:
        return None
    return Bundle(
        name=f"{family.model_type}-fused_qkv",
        purpose="fused_qkv",
        model_types=(family.model_type,),
        description=(
            f"{family.attention} with one fused qkv_proj GEMM in place of q_proj, k_proj and v_proj (GQA, biases, "
            "q/k norms and sliding windows as in stock). Loads stock and fused checkpoints; saves the stock "
            "layout. Not for tensor parallelism (device_map works)."
        ),
        patches=(Patch(family.modeling_module, family.attention, fused_qkv_adapter),),
        conversions={family.model_type: fused_qkv_conversions},
        installers=(refuse_tensor_parallelism,),
        keep_unquantized=family.keep_unquantized,
    )


# Every '-fused_qkv' bundle installs the same guard: the first one in wraps, the last one out puts back.
_ATTRIBUTE = "_resolve_parallel_plans"
_guard_users = 0
_guard_original: Any = None


def _distributed_mixin() -> type:
    # enable_bundle refuses first (_compat.refuse_unsupported); this guards a direct call.
    reason = unsupported_reason("fused_qkv")
    if reason is not None:
        raise UnsupportedTransformersError(f"{reason}.")
    from transformers.distributed.mixin import DistributedMixin

    return DistributedMixin


def refuse_tensor_parallelism(options: BundleOptions) -> Callable[[], None]:
    """Installer: wrap DistributedMixin._resolve_parallel_plans with the fused-attention check."""
    global _guard_users, _guard_original
    mixin = _distributed_mixin()
    if _guard_users == 0:
        _guard_original = mixin.__dict__[_ATTRIBUTE]
        setattr(mixin, _ATTRIBUTE, _guarded(_guard_original))
    _guard_users += 1
    restored = False

    def restore() -> None:
        global _guard_users, _guard_original
        nonlocal restored
        if restored:
            return
        restored = True
        _guard_users -= 1
        if _guard_users == 0:
            setattr(mixin, _ATTRIBUTE, _guard_original)
            _guard_original = None

    return restore


def _guarded(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _resolve_parallel_plans(self: nn.Module, distributed_config: Any) -> Any:
        plans = original(self, distributed_config)
        refuse_plan_through_fused_attention(self, plans[0])
        return plans

    return _resolve_parallel_plans


def refuse_plan_through_fused_attention(model: nn.Module, tp_plan: dict[str, str]) -> None:
    """Raise if the resolved (layer-numbered) tensor-parallel plan shards anything inside a fused attention."""
    fused = [name for name, module in model.named_modules() if isinstance(module, FusedQKVAttention)]
    if not fused or not tp_plan:
        return
    prefixes = tuple(name + "." for name in fused)
    touched = sorted(rule for rule in tp_plan if rule in fused or rule.startswith(prefixes))
    if not touched:
        return
    model_type = getattr(getattr(model, "config", None), "model_type", "<model_type>")
    raise FusedQKVParallelismError(
        f"Tensor parallelism would shard {touched[0]} ({tp_plan[touched[0]]}) inside {fused[0]}, whose q/k/v "
        f"projections the '{model_type}-fused_qkv' bundle fused into one qkv_proj. A column split of the fused "
        "q|k|v weight gives each rank a mix of query, key and value rows instead of its own heads, and "
        "transformers has no style that shards the three blocks separately. Disable the bundle for "
        f"tensor-parallel runs (layerswap.disable_bundle('{model_type}-fused_qkv')), or load without "
        "tensor parallelism (device_map='auto' works)."
    )
