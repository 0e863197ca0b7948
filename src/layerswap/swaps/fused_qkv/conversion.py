"""Checkpoint conversions for FusedQKVAttention.

Loading concatenates a checkpoint's `self_attn.q_proj` / `k_proj` / `v_proj` weights (and biases) into
`self_attn.qkv_proj`; a checkpoint saved fused (`save_pretrained(save_original_format=False)`) has the
`qkv_proj` keys already and loads as is. Saving splits `qkv_proj` back into q, k and v by their real widths.
transformers' own `Concatenate` reverses to an equal-size `Chunk`, which writes wrong shapes under GQA, and its
`Split` reads the widths from the model's `q_proj`, which a fused model lacks.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.core_model_loading import ConversionOps, WeightConverter, WeightTransform

from ..._hf.parallel import row_shards
from ...bundle import BundleOptions

_PREFIX = "self_attn"  # where every family in the catalog keeps its attention module
_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def _single(tensors: Any) -> torch.Tensor:
    if isinstance(tensors, list):
        if len(tensors) != 1:
            raise ValueError(f"expected one tensor per projection, got {len(tensors)}")
        return tensors[0]
    return tensors


class ConcatenateQKV(ConversionOps):
    """q, k, v (in the order of the source patterns) -> one tensor along dim 0. All three must be present."""

    @torch.no_grad()
    def convert(
        self,
        input_dict: dict[str, Any],
        source_patterns: list[str],
        target_patterns: list[str],
        **kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        missing = [pattern for pattern in source_patterns if pattern not in input_dict]
        if missing:
            raise ValueError(
                f"the checkpoint has {sorted(input_dict)} but lacks {missing}; a fused qkv_proj needs all of "
                "q_proj, k_proj and v_proj"
            )
        return {target_patterns[0]: torch.cat([_single(input_dict.pop(p)) for p in source_patterns], dim=0)}

    @property
    def reverse_op(self) -> ConversionOps:
        return SplitQKV()


class SplitQKV(ConversionOps):
    """One fused tensor -> q, k, v (one per target pattern), split along dim 0 at the exact q / k / v widths.

    On save (transformers passes the model) the widths come from the fused attention module the tensor belongs
    to: what the stock code built for that layer, per-layer head counts, gated queries and odd value widths
    included. Without a model they come from the config: num_attention_heads * head_dim, then
    num_key_value_heads * head_dim twice. A `qkv_proj` of a module that is not a FusedQKVAttention passes through.
    """

    @torch.no_grad()
    def convert(
        self,
        input_dict: dict[str, Any],
        source_patterns: list[str],
        target_patterns: list[str],
        full_layer_name: str | None = None,
        model: torch.nn.Module | None = None,
        config: Any = None,
        **kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        if len(input_dict) != 1 or len(target_patterns) != 3:
            raise ValueError(f"SplitQKV expects one fused tensor and three targets, got {sorted(input_dict)}")
        fused = _single(next(iter(input_dict.values())))
        shards = 1
        if model is not None and full_layer_name:
            module_name, parameter = _module_and_parameter(full_layer_name)
            module = _submodule(model, module_name)
            sizes = getattr(module, "qkv_sizes", None)
            if sizes is not None:
                shards = row_shards(getattr(module.qkv_proj, parameter))
            if sizes is None:
                # A stock module that has its own `qkv_proj` (minimax's linear-attention layers): saved as is,
                # under its full name, which transformers leaves unprefixed.
                return {f"{module_name}.qkv_proj.{parameter}": fused}
            source = f"{module_name}.qkv_sizes"
        else:
            sizes, source = config_qkv_sizes(config), "the config's head counts and head_dim"
        if sum(sizes) != fused.shape[0]:
            raise ValueError(
                f"cannot split the fused qkv tensor of {full_layer_name} with {fused.shape[0]} rows into q/k/v "
                f"widths {sizes} (from {source}); the tensor does not belong to this attention"
            )
        # Gathered from tensor-parallel ranks, the rows are rank after rank, each rank's q heads, k heads, v heads
        # (FusedQKVAttention._layerswap_check_tensor_parallel): each projection is its parts from every rank.
        local_sizes = [size // shards for size in sizes]
        blocks = [block.split(local_sizes, dim=0) for block in fused.chunk(shards, dim=0)]
        # cat copies: safetensors cannot save three views of one storage.
        return {
            target: torch.cat([block[index] for block in blocks])
            for index, target in enumerate(target_patterns)
        }

    @property
    def reverse_op(self) -> ConversionOps:
        return ConcatenateQKV()


def _module_and_parameter(full_layer_name: str) -> tuple[str, str]:
    """`model.layers.0.self_attn.q_proj.weight` (the first target's full name, on save) -> module, parameter."""
    module_name, _, parameter = full_layer_name.rsplit(".", 2)
    return module_name, parameter


def _submodule(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def config_qkv_sizes(config: Any) -> tuple[int, int, int]:
    if config is None:
        raise ValueError("SplitQKV needs the model config to know the q/k/v widths")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return heads * head_dim, kv_heads * head_dim, kv_heads * head_dim


class FusedQKVConverter(WeightConverter):
    """q/k/v -> qkv_proj on load; its reverse splits on save.

    Its target is `qkv_proj.weight` (or `.bias`), a key the fused model has: transformers only accepts renamed
    keys that exist. It reports itself used even when a fused checkpoint loaded without it, so `save_pretrained`
    always writes the stock q/k/v layout.
    """

    __slots__ = ()

    def was_used(self) -> bool:
        return True


def fused_qkv_conversions(stock: list[WeightTransform], options: BundleOptions) -> list[WeightTransform]:
    """The ConversionEdit of the '-fused_qkv' bundles: keep every other transform (the family's renamings and
    expert merges, or what the '-quant' edit made of them) and add the q/k/v fusion for weights and biases."""
    kept = [transform for transform in stock if not isinstance(transform, FusedQKVConverter)]
    fusions = [
        FusedQKVConverter(
            source_patterns=[f"{_PREFIX}.{projection}.{parameter}" for projection in _PROJECTIONS],
            target_patterns=f"{_PREFIX}.qkv_proj.{parameter}",
            operations=[ConcatenateQKV()],
        )
        for parameter in ("weight", "bias")
    ]
    return [*kept, *fusions]
