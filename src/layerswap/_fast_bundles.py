"""The '<model_type>-fast' bundles: fused-MoE experts (Triton on CUDA, the fast PyTorch path elsewhere), plus
fused-QKV attention where the family has a '-fused_qkv' adapter."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ._bundle import Bundle, BundleOptions, Patch
from .adapters.attention import fused_qkv_adapter
from .adapters.fused_experts import FusedExpertsForwardMixin
from .conversions.qkv import fused_qkv_conversions

if TYPE_CHECKING:
    from .catalog import Family


def fused_experts_adapter(original: type[nn.Module], options: BundleOptions) -> type[nn.Module]:
    """A subclass of the stock Experts class whose forward runs `layerswap.kernels.fused_moe`. It keeps the stock
    3D parameters, so the stock conversions load and save it unchanged and `_init_weights` finds what it expects."""
    return type(
        f"Fused{original.__name__}",
        (FusedExpertsForwardMixin, original),
        {
            "_layerswap_original": original,
            "_layerswap_strict": True,  # a checkpoint lacking expert weights is an error, never a random init
            "__module__": __name__,
            "__doc__": f"{original.__name__} computed by layerswap's fused-MoE kernels.",
        },
    )


def fast_bundle(family: Family) -> Bundle | None:
    if family.experts is None:
        return None
    patches = [Patch(family.modeling_module, family.experts, fused_experts_adapter)]
    conversions = {}
    if family.attention is not None:
        from ._fused_qkv_bundles import EXCLUDED, refuse_tensor_parallelism

        if family.model_type not in EXCLUDED:
            patches.append(Patch(family.modeling_module, family.attention, fused_qkv_adapter))
            conversions[family.model_type] = fused_qkv_conversions
    fused_attention = len(patches) == 2
    return Bundle(
        name=f"{family.model_type}-fast",
        purpose="fast",
        model_types=(family.model_type,),
        description=(
            f"{family.experts} computed by a fused-MoE kernel (Triton on CUDA, a sorted grouped PyTorch path "
            "elsewhere), stock weights and checkpoints"
            + (f", plus {family.attention} with one fused qkv_proj." if fused_attention else ".")
        ),
        patches=tuple(patches),
        conversions=conversions,
        installers=(refuse_tensor_parallelism,) if fused_attention else (),
        requirements=("CUDA + triton for the Triton kernel; the PyTorch path is used otherwise",),
        keep_unquantized=family.keep_unquantized,
    )
