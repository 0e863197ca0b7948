"""Public fused-MoE experts entry point: backend choice, input checks, and the torch custom op.

    out = fused_moe(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, activation="silu")

The Triton kernels live in `triton_moe` (their tile configs in `configs`) and are imported only when the
Triton backend runs, so this
module (and the torch backend) work without triton installed. On CPU the torch backend runs the strategy
this machine measured fastest for the dtype, token count and shape (`cpu_dispatch`); elsewhere, and whenever
autograd needs gradients, `fused_moe_reference`. Under torch.compile the call goes through the
custom op `layerswap::fused_moe`, which `torch.compile(fullgraph=True)` treats as one opaque node (the torch
backend's per-expert loop depends on routing values and could not be traced otherwise); eager calls run the
same implementation directly.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

import torch

from .configs import ACTIVATION_CODES, KernelInputError
from .cpu_dispatch import cpu_fused_moe
from .torch_moe import Activation, fused_moe_reference

Backend = Literal["triton", "torch"]


@functools.cache
def triton_available() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or half-removed install counts as missing
        return False


def _triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _resolve_backend(backend: Backend | None, hidden_states: torch.Tensor) -> Backend:
    if backend is None:
        return "triton" if hidden_states.is_cuda and triton_available() else "torch"
    if backend == "torch":
        return backend
    if backend != "triton":
        raise KernelInputError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    if not triton_available():
        raise KernelInputError("backend='triton' needs the triton package: pip install 'layerswap[cuda]'")
    if not hidden_states.is_cuda and not _triton_interpreting():
        raise KernelInputError(
            f"backend='triton' needs CUDA tensors, got {hidden_states.device}; use backend='torch' on CPU "
            "(or set TRITON_INTERPRET=1 before importing triton to run the kernels in Triton's interpreter)"
        )
    return backend


def _check_inputs(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> None:
    """Shape and dtype checks only: nothing here reads tensor values, so nothing syncs with the device."""
    if hidden_states.dim() != 2:
        raise KernelInputError(f"hidden_states must be [T, H], got shape {tuple(hidden_states.shape)}")
    num_tokens, hidden_size = hidden_states.shape
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[2] != hidden_size or gate_up_proj.shape[1] % 2:
        raise KernelInputError(
            f"gate_up_proj must be [E, 2I, H={hidden_size}] (gate rows, then up rows), "
            f"got {tuple(gate_up_proj.shape)}"
        )
    num_experts, two_intermediate, _ = gate_up_proj.shape
    expected_down = (num_experts, hidden_size, two_intermediate // 2)
    if tuple(down_proj.shape) != expected_down:
        raise KernelInputError(f"down_proj must be [E, H, I] = {expected_down}, got {tuple(down_proj.shape)}")
    if down_proj.dtype != gate_up_proj.dtype:
        raise KernelInputError(f"gate_up_proj is {gate_up_proj.dtype} but down_proj is {down_proj.dtype}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != num_tokens:
        raise KernelInputError(f"top_k_index must be [T={num_tokens}, K], got {tuple(top_k_index.shape)}")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype.is_complex or top_k_index.dtype == torch.bool:
        raise KernelInputError(f"top_k_index must hold integer expert ids, got {top_k_index.dtype}")
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise KernelInputError(
            f"top_k_weights must have top_k_index's shape {tuple(top_k_index.shape)}, "
            f"got {tuple(top_k_weights.shape)}"
        )


def _fused_moe_impl(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    activation: str,
    backend: str,
) -> torch.Tensor:
    if backend == "triton":
        from .triton_moe import fused_moe_triton

        return fused_moe_triton(
            hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, activation
        )
    if gate_up_proj.device.type == "cpu":
        return cpu_fused_moe(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, activation)
    return fused_moe_reference(
        hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, activation=activation
    )


_fused_moe_op = torch.library.custom_op("layerswap::fused_moe", _fused_moe_impl, mutates_args=())


@_fused_moe_op.register_fake
def _fused_moe_fake(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    activation: str,
    backend: str,
) -> torch.Tensor:
    return hidden_states.new_empty(hidden_states.shape)  # both backends return a fresh contiguous [T, H]


def fused_moe(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    activation: Activation = "silu",
    backend: Backend | None = None,
) -> torch.Tensor:
    """MoE experts forward: `out[t] = sum_k w[t,k] * down_e(act(gate_e(x_t)) * up_e(x_t))`, e = top_k_index[t,k].

    Args:
        hidden_states: `[T, H]`, any strides.
        gate_up_proj: `[E, 2I, H]` (gate rows first), read in place.
        down_proj: `[E, H, I]`, read in place.
        top_k_index: `[T, K]` integer expert ids; ids outside [0, E) contribute nothing.
        top_k_weights: `[T, K]` routing weights, applied in fp32.
        activation: "silu", "gelu", "gelu_pytorch_tanh", "relu", or an elementwise callable (torch backend only).
        backend: None picks "triton" for CUDA tensors when triton is installed (and the activation is named),
            else "torch".

    Returns:
        `[T, H]` in `hidden_states.dtype`. When autograd needs gradients the differentiable plain-PyTorch path
        runs instead (the custom op has no backward).
    """
    _check_inputs(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights)
    named = isinstance(activation, str)
    # A custom callable cannot be fused into the kernels, so the automatic choice falls back to torch for it.
    chosen = _resolve_backend(backend, hidden_states) if named or backend is not None else "torch"
    if named and activation not in ACTIVATION_CODES:
        raise KernelInputError(
            f"unknown activation {activation!r}: expected one of {sorted(ACTIVATION_CODES)} or a callable"
        )
    if not named and chosen == "triton":
        raise KernelInputError(
            "the Triton kernels fuse named activations only; pass one of "
            f"{sorted(ACTIVATION_CODES)} or use backend='torch' for a custom callable"
        )
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (hidden_states, gate_up_proj, down_proj, top_k_weights)
    )
    if needs_grad:
        return fused_moe_reference(
            hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, activation=activation
        )
    if not named:  # a callable cannot go through the custom op (its schema takes a name)
        if gate_up_proj.device.type == "cpu" and not torch.compiler.is_compiling():
            return cpu_fused_moe(
                hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, activation=activation
            )
        return fused_moe_reference(
            hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, activation=activation
        )
    # Eager calls skip the custom op's Python dispatch (tens of microseconds, ~1% of a CPU decode step);
    # under torch.compile the op is what keeps the data-dependent implementation out of the graph.
    implementation = torch.ops.layerswap.fused_moe if torch.compiler.is_compiling() else _fused_moe_impl
    return implementation(
        hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, activation, chosen
    )
