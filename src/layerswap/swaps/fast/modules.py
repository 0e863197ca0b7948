"""Stock group-A experts modules running `layerswap.kernels.fused_moe`.

Two ways in:
- `register_experts_backend()` adds "layerswap" to transformers' experts interface, so any group-A model
  loaded with `experts_implementation="layerswap"` (or switched with `model.set_experts_implementation`)
  runs the fused kernels with its own 3D weights; `unregister_experts_backend()` puts back exactly what was
  there.
- `FusedExpertsForwardMixin`, put before a stock Experts class in a subclass's bases, whose `forward` calls
  the fused kernels whatever `experts_implementation` says. The subclass keeps the stock parameters, so
  `_init_weights`, checkpoint loading and saving see the module they expect.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import GELUActivation, GELUTanh, SiLUActivation

from ..._hf import experts as hf_experts
from ..._hf.experts import EXPERTS_IMPLEMENTATION_CHOSEN, configured_implementation
from ...bundle import BundleOptions
from ...kernels import KernelInputError, fused_moe
from ...kernels.torch_moe import Activation

BACKEND_NAME = "layerswap"


def activation_name(act_fn: Callable[[torch.Tensor], torch.Tensor]) -> str | None:
    """The fused-kernel name of a transformers/PyTorch activation, or None when the kernels do not know it.

    Exact types only: a subclass may change the math, and a wrong name would silently change outputs.
    """
    kind = type(act_fn)
    if kind in (SiLUActivation, nn.SiLU) or act_fn is F.silu:
        return "silu"
    if kind is nn.ReLU or act_fn is F.relu:
        return "relu"
    if kind is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_pytorch_tanh"}.get(act_fn.approximate)
    if (kind is GELUActivation and getattr(act_fn, "act", None) is F.gelu) or act_fn is F.gelu:
        return "gelu"
    if kind is GELUTanh:
        inner = getattr(act_fn, "act", None)
        if (
            isinstance(inner, functools.partial)
            and inner.func is F.gelu
            and inner.keywords == {"approximate": "tanh"}
        ):
            return "gelu_pytorch_tanh"
    return None


def _check_group_a(module: nn.Module) -> None:
    """Refuse, naming both sides, a module whose layout or gating the fused kernels would compute wrongly."""
    name = type(module).__qualname__
    for attribute in ("gate_up_proj", "down_proj", "act_fn"):
        if not hasattr(module, attribute):
            raise KernelInputError(
                f"{name} has no `{attribute}`: layerswap's fused experts need the group-A layout"
            )
    # Under expert parallelism each rank holds its own experts (gate_up_proj [E_local, 2I, H]) and marks routes to
    # the others with id E_local (weight 0): the kernels skip ids >= E, as stock skips them.
    mismatches = hf_experts.layout_mismatches(module, expert_parallel_ok=True)
    if mismatches:
        flag, found, expected = mismatches[0]
        raise KernelInputError(
            f"{name}.{flag} is {found}, but layerswap's fused experts support only {flag}={expected} "
            "(gate_up_proj [E, 2I, H] gate rows first, down_proj [E, H, I], no bias); use "
            "experts_implementation='grouped_mm' for this module"
        )
    if hf_experts.overrides_apply_gate(type(module)):
        raise KernelInputError(
            f"{name} overrides _apply_gate (e.g. a clamped or interleaved gate), but layerswap's fused experts "
            "compute act(gate) * up only; use experts_implementation='grouped_mm' for this module"
        )


def fused_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """An ExpertsInterface backend: the stock Experts forward contract, computed by `fused_moe`."""
    _check_group_a(self)
    activation: Activation = activation_name(self.act_fn) or self.act_fn
    return fused_moe(
        hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights, activation=activation
    )


class FusedExpertsForwardMixin:
    """Put first in the bases of a stock group-A Experts subclass: its forward runs the fused kernels."""

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return fused_experts_forward(self, hidden_states, top_k_index, top_k_weights)  # type: ignore[arg-type]


def register_experts_backend() -> None:
    """Make `experts_implementation="layerswap"` available. Idempotent; the first call records what it hides."""
    hf_experts.register_backend(BACKEND_NAME, fused_experts_forward)


def unregister_experts_backend() -> None:
    """Undo `register_experts_backend` exactly: the entry it replaced comes back, or the name goes away."""
    hf_experts.unregister_backend(BACKEND_NAME)


def fused_experts_adapter(original: type[nn.Module], options: BundleOptions) -> type[nn.Module]:
    """A subclass of the stock Experts class whose forward runs `layerswap.kernels.fused_moe`. It keeps the stock
    3D parameters, so the stock conversions load and save it unchanged and `_init_weights` finds what it expects.

    An experts implementation chosen after the model was built (`model.set_experts_implementation(...)`, or a
    changed config) runs instead, through the stock forward: the fused kernels are the default, not a lock."""

    def __init__(self: nn.Module, config: Any, *args: Any, **kwargs: Any) -> None:
        original.__init__(self, config, *args, **kwargs)
        self._built_experts_implementation = configured_implementation(config)

    def forward(
        self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        current = configured_implementation(self.config)
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
