"""The '<model_type>-fast' bundles: fused-MoE experts (Triton on CUDA, the fast PyTorch path elsewhere), plus
fused-QKV attention where the family has a '-fused_qkv' adapter."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.core_model_loading import WeightTransform

from ._bundle import Bundle, BundleOptions, Patch
from ._load_hooks import EXPERTS_IMPLEMENTATION_CHOSEN
from .adapters.attention import fused_qkv_adapter
from .adapters.fused_experts import BACKEND_NAME, FusedExpertsForwardMixin
from .conversions.qkv import fused_qkv_conversions
from .conversions.shape_checks import shape_checked_expert_merges

if TYPE_CHECKING:
    from .catalog import Family


def fused_experts_adapter(original: type[nn.Module], options: BundleOptions) -> type[nn.Module]:
    """A subclass of the stock Experts class whose forward runs `layerswap.kernels.fused_moe`. It keeps the stock
    3D parameters, so the stock conversions load and save it unchanged and `_init_weights` finds what it expects.

    An experts implementation chosen after the model was built (`model.set_experts_implementation(...)`, or a
    changed config) runs instead, through the stock forward: the fused kernels are the default, not a lock."""

    def __init__(self: nn.Module, config: Any, *args: Any, **kwargs: Any) -> None:
        original.__init__(self, config, *args, **kwargs)
        self._built_experts_implementation = getattr(config, "_experts_implementation", None)

    def forward(
        self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        current = getattr(self.config, "_experts_implementation", None)
        chosen = (
            self.__dict__.get(EXPERTS_IMPLEMENTATION_CHOSEN, False)
            or current != self._built_experts_implementation
        )
        if chosen and current != BACKEND_NAME:
            return original.forward(self, hidden_states, top_k_index, top_k_weights)
        return FusedExpertsForwardMixin.forward(self, hidden_states, top_k_index, top_k_weights)

    def check_experts_implementation(self: nn.Module, requested: str) -> None:
        """Called by `model.set_experts_implementation` (while a bundle is enabled): any implementation runs."""

    return type(
        f"Fused{original.__name__}",
        (FusedExpertsForwardMixin, original),
        {
            "_layerswap_original": original,
            "_layerswap_strict": True,  # a checkpoint lacking expert weights is an error, never a random init
            "__init__": __init__,
            "forward": forward,
            "_layerswap_check_experts_implementation": check_experts_implementation,
            "__module__": __name__,
            "__doc__": f"{original.__name__} computed by layerswap's fused-MoE kernels.",
        },
    )


def _fast_conversions(stock: list[WeightTransform], options: BundleOptions) -> list[WeightTransform]:
    return fused_qkv_conversions(shape_checked_expert_merges(stock, options), options)


def fast_bundle(family: Family) -> Bundle | None:
    if family.experts is None:
        return None
    patches = [Patch(family.modeling_module, family.experts, fused_experts_adapter)]
    conversions = {family.model_type: shape_checked_expert_merges}
    if family.attention is not None:
        from ._fused_qkv_bundles import EXCLUDED, refuse_tensor_parallelism

        if family.model_type not in EXCLUDED:
            patches.append(Patch(family.modeling_module, family.attention, fused_qkv_adapter))
            conversions[family.model_type] = _fast_conversions
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
