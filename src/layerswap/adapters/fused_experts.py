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
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import GELUActivation, GELUTanh, SiLUActivation
from transformers.integrations import moe as hf_moe

from ..kernels.fused_moe import KernelInputError, fused_moe
from ..kernels.reference import Activation

BACKEND_NAME = "layerswap"

# What the use_experts_implementation decorator records on a group-A module; anything else is another layout.
_GROUP_A_FLAGS = {
    "has_gate": True,
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_post_expert_norm": False,
    "_is_expert_parallel": False,
}


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
    for flag, expected in _GROUP_A_FLAGS.items():
        found = getattr(module, flag, expected)
        if found != expected:
            raise KernelInputError(
                f"{name}.{flag} is {found}, but layerswap's fused experts support only {flag}={expected} "
                "(gate_up_proj [E, 2I, H] gate rows first, down_proj [E, H, I], no bias, one process per "
                "expert set); use experts_implementation='grouped_mm' for this module"
            )
    apply_gate = getattr(type(module), "_apply_gate", hf_moe._default_apply_gate)
    if apply_gate is not hf_moe._default_apply_gate:
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


_MISSING = object()
_lock = threading.Lock()
_saved_entry: object = _MISSING  # what the interface's local mapping held under BACKEND_NAME before us
_registered = False


def register_experts_backend() -> None:
    """Make `experts_implementation="layerswap"` available. Idempotent; the first call records what it hides."""
    global _saved_entry, _registered
    with _lock:
        if _registered:
            return
        # The instance's local mapping is what every group-A class and from_pretrained look up first; the
        # class-level ExpertsInterface.register would be shadowed by a local entry of the same name.
        local = hf_moe.ALL_EXPERTS_FUNCTIONS._local_mapping
        _saved_entry = local.get(BACKEND_NAME, _MISSING)
        hf_moe.ALL_EXPERTS_FUNCTIONS[BACKEND_NAME] = fused_experts_forward
        _registered = True


def unregister_experts_backend() -> None:
    """Undo `register_experts_backend` exactly: the entry it replaced comes back, or the name goes away."""
    global _saved_entry, _registered
    with _lock:
        if not _registered:
            return
        local = hf_moe.ALL_EXPERTS_FUNCTIONS._local_mapping
        if _saved_entry is _MISSING:
            local.pop(BACKEND_NAME, None)
        else:
            local[BACKEND_NAME] = _saved_entry
        _saved_entry = _MISSING
        _registered = False
