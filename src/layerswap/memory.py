"""Exact weight footprint of a model under a bitsandbytes scheme, computed from its module tree (meta is fine).

It replays what transformers' bitsandbytes quantizers do to the model before loading weights, without loading
any: the modules they would replace (exact type `nn.Linear`, not in modules-not-to-convert: output embeddings,
tied weights, the last parameter's module, `llm_int8_skip_modules`, `_keep_in_fp32_modules`, and the
keep-unquantized hints of the enabled layerswap bundles), and then counts bytes as `get_memory_footprint()` does
on the loaded model: every parameter and buffer, a 4-bit weight as numel/2 bytes, an 8-bit weight as numel bytes,
everything else at the load dtype (floating buffers keep their own dtype: rotary `inv_freq` stays fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ._hf.quantizers import keep_in_fp32_strict, modules_not_to_convert
from .errors import BundleError

SCHEMES = ("bf16", "nf4", "int8")
# Storage bytes per element of a weight that bitsandbytes replaced: Params4bit packs two values in one uint8
# (nf4 and fp4 alike), Int8Params holds one int8.
_QUANTIZED_WEIGHT_BYTES = {"nf4": 0.5, "int8": 1.0}


@dataclass(frozen=True)
class Footprint:
    """Bytes of one model under one scheme: `total_bytes` = parameters (quantized or kept at the load dtype) +
    `buffer_bytes`. `quantized_params` and `kept_params` count logical elements."""

    scheme: str
    total_bytes: int
    quantized_bytes: int
    buffer_bytes: int
    quantized_params: int
    kept_params: int
    quantized_modules: int

    @property
    def total_gib(self) -> float:
        return self.total_bytes / 2**30


def bnb_replaced_linears(model: nn.Module, skip_modules: list[str] | None = None) -> list[str]:
    """Names of the modules that transformers' `replace_with_bnb_linear` would replace in `model`."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    patterns = modules_not_to_convert(model, skip_modules)
    return [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and should_convert_module(name, patterns)
    ]


def _strict_fp32_names(model: nn.Module, dtype: torch.dtype) -> set[str]:
    strict = keep_in_fp32_strict(model)
    if not strict or dtype not in (torch.float16, torch.bfloat16):
        return set()
    return {name for name, _ in model.named_parameters() if any(s in name for s in strict)}


def weight_footprint(
    model: nn.Module,
    scheme: str = "nf4",
    dtype: torch.dtype = torch.bfloat16,
    skip_modules: list[str] | None = None,
) -> Footprint:
    """Bytes `get_memory_footprint()` would report once `model` is loaded with `dtype` and bitsandbytes
    `scheme` ("nf4", "int8", or "bf16" for no quantization), with the bundles that are enabled now.

    Build and measure the model under the same bundles: `with use_bundle("qwen2_moe-quant"):
    weight_footprint(meta_model(config))`. Shared (tied) parameters count once, as in `parameters()`."""
    if scheme not in SCHEMES:
        raise BundleError(f"Unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}.")
    replaced = set(bnb_replaced_linears(model, skip_modules)) if scheme in _QUANTIZED_WEIGHT_BYTES else set()
    quantized_weights = {id(model.get_submodule(name).weight) for name in replaced}
    fp32_names = _strict_fp32_names(model, dtype)
    total = quantized_bytes = quantized_params = kept_params = 0
    for name, parameter in model.named_parameters():  # deduplicated, like parameters()
        if id(parameter) in quantized_weights:
            size = int(parameter.numel() * _QUANTIZED_WEIGHT_BYTES[scheme] + 0.5)
            quantized_bytes += size
            quantized_params += parameter.numel()
        else:
            itemsize = 4 if name in fp32_names else dtype.itemsize
            size = parameter.numel() * (
                itemsize if parameter.is_floating_point() else parameter.element_size()
            )
            kept_params += parameter.numel()
        total += size
    buffers = sum(buffer.numel() * buffer.element_size() for buffer in model.buffers())
    return Footprint(
        scheme, total + buffers, quantized_bytes, buffers, quantized_params, kept_params, len(replaced)
    )
