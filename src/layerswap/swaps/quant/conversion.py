"""Checkpoint conversions for LinearExperts.

A LinearExperts model names its weights like the family's per-expert checkpoints
(`mlp.experts.3.gate_proj.weight`, mixtral `mlp.experts.3.w1.weight`), so per-expert checkpoints load by the
family's stock renamings alone, with no 2D -> 3D -> 2D round trip. Fused checkpoints (`mlp.experts.gate_up_proj`,
what `save_pretrained(save_original_format=False)` writes) are split on load. Saving writes the family's stock
layout: per-expert for families whose stock conversions merge per-expert keys, fused for the others.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch
from transformers.core_model_loading import (
    Concatenate,
    ConversionOps,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
)

from ..._hf.conversions import source_patterns, target_patterns
from ...bundle import BundleOptions
from .._stock_layout import experts_layout, is_per_expert_merge

_AT_NAME_START = r"(?<![^.])"


class SplitFusedExperts(ConversionOps):
    """Fused `[E, 2I, H]` gate_up (or `[E, H, I]` down) -> one tensor per expert and projection.

    `targets` are per-expert key patterns with `*` for the expert index; two targets split gate_up into gate
    (first half of dim 1) and up, one target takes down as is.
    """

    def __init__(self, targets: tuple[str, ...]) -> None:
        self.targets = targets

    @torch.no_grad()
    def convert(
        self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kwargs
    ):
        if len(input_dict) != 1:
            raise ValueError(f"SplitFusedExperts expects one fused tensor, got {sorted(input_dict)}")
        tensor = next(iter(input_dict.values()))
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        if tensor.dim() != 3:
            raise ValueError(
                f"SplitFusedExperts expects a 3D [E, N, K] experts tensor, got {tuple(tensor.shape)}"
            )
        parts = tensor.chunk(len(self.targets), dim=1)
        return {
            target.removeprefix(_AT_NAME_START).replace("*", str(expert)): _with_own_storage(part[expert])
            for target, part in zip(self.targets, parts, strict=True)
            for expert in range(tensor.shape[0])
        }


def _with_own_storage(piece: torch.Tensor) -> torch.Tensor:
    """One expert's slice of a fused tensor as a tensor with a storage of its own, over the same memory on CPU.

    Plain views would share the fused tensor's storage, and savers that refuse or deduplicate tensors sharing a
    storage would then fail or drop experts (safetensors' `save_file` raises; accelerate's `save_model` keeps one
    tensor per storage). A copy per expert would hold the experts twice while the fused tensor (often the mmapped
    checkpoint) is alive. A storage slice aliases the expert's bytes and keeps the fused tensor alive: no copy, no
    sharing. Off the CPU, where the fused tensor is a transient the loader frees after the split, it is copied."""
    piece = piece.contiguous()  # copies only when a stock pre-op (a transpose) left a strided view
    if piece.device.type != "cpu":
        return piece.clone()
    start = piece.storage_offset() * piece.element_size()
    storage = piece.untyped_storage()[start : start + piece.nbytes]
    return torch.empty(0, dtype=piece.dtype).set_(storage, 0, piece.shape, piece.stride())


# WeightConverter takes force_cpu from transformers 5.16 on; 5.15's converters always convert where they load.
_TAKES_FORCE_CPU = "force_cpu" in inspect.signature(WeightConverter.__init__).parameters


class FusedToLinearExperts(WeightConverter):
    """Loads a fused experts tensor into LinearExperts' per-expert weights.

    The converter's target is the first real per-expert key (`...experts.0.gate_proj.weight`): transformers only
    accepts a renamed key that the model has, and SplitFusedExperts then names every expert's tensor.
    With `saves_fused`, saving merges the experts back (the family's stock layout is fused); without, saving
    leaves the per-expert keys as they are (the stock layout is per-expert) and the converter is load-only.
    """

    __slots__ = ("per_expert_targets", "saves_fused")

    def __init__(
        self,
        source_patterns: str | list[str],
        target_patterns: str | list[str],
        operations: list[ConversionOps],
        force_cpu: bool = False,
        *,
        per_expert_targets: tuple[str, ...] = (),
        saves_fused: bool = False,
    ) -> None:
        super().__init__(
            source_patterns, target_patterns, operations, *([force_cpu] if _TAKES_FORCE_CPU else [])
        )
        self.per_expert_targets = per_expert_targets
        self.saves_fused = saves_fused

    def copy(self, source_patterns, target_patterns, **kwargs) -> WeightConverter:
        kwargs.setdefault("per_expert_targets", self.per_expert_targets)
        kwargs.setdefault("saves_fused", self.saves_fused)
        return super().copy(source_patterns, target_patterns, **kwargs)

    def was_used(self) -> bool:
        # from_pretrained keeps the transforms that were used, to reverse them on save; a load-only one is not.
        return self.saves_fused and super().was_used()

    def reverse_transform(self) -> WeightTransform:
        if not self.saves_fused:
            return _never_matching_renaming()
        operations = [MergeModulelist(dim=0)]
        if len(self.per_expert_targets) == 2:
            operations.append(Concatenate(dim=1))
        operations += [op.reverse_op for op in self.operations[-2::-1]]
        reverse = _MergeToFusedExperts(
            source_patterns=list(self.per_expert_targets),
            target_patterns=source_patterns(self),
            operations=operations,
        )
        reverse.scope_prefix, reverse.base_model_prefix = self.scope_prefix, self.base_model_prefix
        return reverse


class _MergeToFusedExperts(WeightConverter):
    """Saves per-expert weights merged into one fused tensor, named by the key transformers converts it for.

    That key is the full name the tensor saves under, whichever order transformers renames in: from 5.16 on it
    converts first and renames the result; 5.15 renames first, so a converter whose stock name a renaming then
    changes (granitemoe's `experts.gate_up_proj` -> `input_linear.weight`) found no prefix to keep and saved
    `experts.gate_up_proj` at the top level. Naming the one result by that key is what later releases do anyway.
    """

    __slots__ = ()

    def convert(self, layer_name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        converted = super().convert(layer_name, *args, **kwargs)
        if len(converted) == 1 and len(self.target_patterns) == 1 and "*" not in layer_name:
            return {layer_name: next(iter(converted.values()))}
        return converted


def _never_matching_renaming() -> WeightRenaming:
    return WeightRenaming(source_patterns=r"(?!)", target_patterns=r"(?!)")


def linear_experts_conversions(stock: list[WeightTransform], options: BundleOptions) -> list[WeightTransform]:
    """The ConversionEdit of the `-quant` bundles: drop the stock per-expert -> 3D merges (LinearExperts is
    named like per-expert checkpoints already) and load fused checkpoints by splitting them."""
    layout = experts_layout(stock)
    names = layout.names
    kept: list[WeightTransform] = []
    # A stock converter acting on the fused tensor itself (e.g. a transpose) runs before the split.
    fused_ops: dict[str, tuple[list[str], list[ConversionOps]]] = {}
    for transform in stock:
        if is_per_expert_merge(transform):
            continue
        targets = target_patterns(transform)
        target = targets[0] if targets else ""
        if isinstance(transform, WeightConverter) and target.endswith(
            ("experts.gate_up_proj", "experts.down_proj")
        ):
            fused_ops[target.rsplit(".", 1)[-1]] = (source_patterns(transform), transform.operations)
            continue
        kept.append(transform)
    prefix = layout.experts_prefix.lstrip(".")
    for fused, projections in (("gate_up_proj", (names.gate, names.up)), ("down_proj", (names.down,))):
        # Anchored at a name boundary: `experts.down_proj` must not match `shared_experts.down_proj`.
        targets = tuple(f"{_AT_NAME_START}{prefix}.*.{name}.weight" for name in projections)
        sources, pre_ops = fused_ops.get(fused, ([f"{_AT_NAME_START}{re.escape(prefix)}\\.{fused}"], []))
        kept.append(
            FusedToLinearExperts(
                source_patterns=sources,
                target_patterns=f"{prefix}.0.{projections[0]}.weight",
                operations=[*pre_ops, SplitFusedExperts(targets)],
                per_expert_targets=targets,
                saves_fused=not layout.per_expert_checkpoints,
            )
        )
    return kept
