"""calibrate_all_experts: every expert sees every calibration token, the model's outputs stay the same.

Calibration-based quantizers (GPTQ, AWQ, SmoothQuant) collect statistics with forward hooks on each expert's
nn.Linear layers. A routed MoE feeds an expert only the tokens routed to it, so rarely chosen experts get
little or no calibration data. Inside `calibrate_all_experts`, each experts module, after its normal (routed)
forward, runs every expert on the tokens that were NOT routed to it and discards the result: each expert's linear
layers see every token exactly once, and the layer output is the untouched routed one. llm-compressor's `oneshot`
asks for the same by default (`moe_calibrate_all_experts=True`), which the experts honour without this wrapper
(`layerswap.swaps.quant.all_experts`); both together still feed each token once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

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
    previous = [module.__dict__.get("_layerswap_all_experts_chunk") for module in experts]
    for module in experts:
        module._layerswap_all_experts_chunk = chunk_size
    try:
        yield
    finally:
        for module, chunk in zip(experts, previous, strict=True):
            if chunk is None:
                module.__dict__.pop("_layerswap_all_experts_chunk", None)
            else:
                module._layerswap_all_experts_chunk = chunk


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
