"""calibrate_all_experts: every expert sees every calibration token, the model's outputs stay the same.

Calibration-based quantizers (GPTQ, AWQ, SmoothQuant) collect statistics with forward hooks on each expert's
nn.Linear layers. A routed MoE feeds an expert only the tokens routed to it, so rarely chosen experts get
little or no calibration data. Inside `calibrate_all_experts`, after each experts module's normal (routed)
forward, a forward hook runs every expert on the tokens that were NOT routed to it and discards the result:
each expert's linear layers see every token exactly once, and the layer output is the untouched routed one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .errors import BundleError
from .families import FAMILIES
from .swaps.quant import LinearExperts


@contextmanager
def calibrate_all_experts(model: nn.Module, chunk_size: int = 1024) -> Iterator[None]:
    """Within the block, every expert of every MoE layer processes every token; outputs are unchanged.

    The extra tokens go through each expert `chunk_size` at a time, so memory stays bounded by one chunk's
    activations. Needs the experts as nn.Linear layers: load the model with its '<model_type>-quant' bundle.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise BundleError(f"calibrate_all_experts: chunk_size must be a positive int, got {chunk_size!r}.")
    experts = [module for module in model.modules() if isinstance(module, LinearExperts)]
    if not experts:
        raise BundleError(_no_linear_experts_message(model))
    refused = {
        type(m).__name__: m._layerswap_calibration_refusal
        for m in experts
        if m._layerswap_calibration_refusal
    }
    if refused:
        name, reason = next(iter(refused.items()))
        raise BundleError(
            f"calibrate_all_experts cannot serve {name}: {reason}. Calibrate with enough tokens for every expert "
            "instead, and check each expert's statistics."
        )
    hook = _feed_unrouted_tokens(chunk_size)
    handles = [module.register_forward_hook(hook, with_kwargs=True) for module in experts]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _feed_unrouted_tokens(chunk_size: int) -> Any:
    def hook(module: LinearExperts, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
        rows = module._layerswap_routed_rows(args, kwargs)
        if rows is None:  # every expert saw every token
            return
        hidden_states, top_k_index = rows
        with torch.no_grad():
            # The real experts only: longcat_flash's identity experts compute nothing.
            for expert_index in range(module.num_experts):
                expert = module[expert_index]
                unrouted = (top_k_index != expert_index).all(dim=-1).nonzero().squeeze(1)
                for start in range(0, unrouted.numel(), chunk_size):
                    expert(hidden_states[unrouted[start : start + chunk_size]])

    return hook


def _no_linear_experts_message(model: nn.Module) -> str:
    stock_experts = {family.experts: family.model_type for family in FAMILIES if family.experts}
    fused = next((m for m in model.modules() if type(m).__name__ in stock_experts), None)
    if fused is not None:
        model_type = stock_experts[type(fused).__name__]
        return (
            f"calibrate_all_experts needs each expert as nn.Linear layers, but this model's experts are the stock "
            f"{type(fused).__name__} (fused 3D parameters, no per-expert modules to hook). Load the model with "
            f"the '{model_type}-quant' bundle enabled (layerswap.use_bundle('{model_type}-quant'))."
        )
    return (
        f"calibrate_all_experts found no MoE experts in {type(model).__name__}: it needs a model loaded with a "
        "'<model_type>-quant' bundle (`layerswap list`)."
    )
