"""Stock per-expert merges that name a wrong-shaped checkpoint tensor.

Stock transformers stacks a layer's per-expert weights (`mlp.experts.3.down_proj.weight`) into one 3D tensor with
`MergeModulelist`. When one expert's tensor has another shape, `torch.stack` raises, transformers records the error
and skips the layer's whole group, and the load reports the fused weight as missing: neither the checkpoint tensor
nor its shape reaches the exception. The '-fast' bundles keep the stock merges with this check in front, so the
load guard raises CheckpointShapeError naming the tensor, its shape and the shape the model expects.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from typing import Any

import torch
from transformers.core_model_loading import MergeModulelist, WeightConverter, WeightTransform

from ...bundle import BundleOptions
from ...errors import CheckpointShapeError
from .._stock_layout import is_per_expert_merge


class ShapeCheckedMergeModulelist(MergeModulelist):
    """MergeModulelist that first checks every expert's tensor has the same shape, naming those that do not."""

    @torch.no_grad()
    def convert(
        self,
        input_dict: dict[str, list[torch.Tensor]],
        source_patterns: list[str],
        target_patterns: list[str],
        **kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        for source, tensors in input_dict.items():
            if isinstance(tensors, torch.Tensor):
                continue
            shapes = [tuple(t.shape) for t in tensors]
            usual, _ = Counter(shapes).most_common(1)[0]
            odd = [index for index, shape in enumerate(shapes) if shape != usual]
            if odd:
                raise CheckpointShapeError(_describe(source, shapes, usual, odd, target_patterns, kwargs))
        return super().convert(input_dict, source_patterns, target_patterns, **kwargs)


def _describe(
    source: str,
    shapes: list[tuple[int, ...]],
    usual: tuple[int, ...],
    odd: list[int],
    target_patterns: list[str],
    kwargs: dict[str, Any],
) -> str:
    layer_name = kwargs.get("full_layer_name") or ""
    prefix = ""
    for target in target_patterns:
        literal = target.replace("\\", "")
        if literal and literal in layer_name:
            prefix = layer_name[: layer_name.index(literal)]
            break
    pattern = re.sub(r"\\(.)", r"\1", source).lstrip("^").rstrip("$")
    named = ", ".join(f"{prefix}{pattern.replace('*', str(i))} has shape {shapes[i]}" for i in odd[:4])
    more = f" and {len(odd) - 4} more" if len(odd) > 4 else ""
    expected = ""
    model = kwargs.get("model")
    if model is not None and layer_name:
        with contextlib.suppress(AttributeError, KeyError):
            expected = f"; the model's {layer_name} is {tuple(model.get_parameter(layer_name).shape)}"
    return (
        f"{named}{more}, but the other {len(shapes) - len(odd)} experts of the layer have shape {usual}, so the "
        f"experts cannot be stacked{expected}"
    )


def shape_checked_expert_merges(
    stock: list[WeightTransform], options: BundleOptions
) -> list[WeightTransform]:
    """ConversionEdit: the stock per-expert merges with ShapeCheckedMergeModulelist in place of MergeModulelist;
    every other transform as it is."""
    edited = []
    for transform in stock:
        if (
            isinstance(transform, WeightConverter)
            and is_per_expert_merge(transform)
            and type(transform.operations[0]) is MergeModulelist
        ):
            transform.operations = [
                ShapeCheckedMergeModulelist(transform.operations[0].dim),
                *transform.operations[1:],
            ]
        edited.append(transform)
    return edited
