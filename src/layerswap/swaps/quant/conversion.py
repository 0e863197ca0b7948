"""Checkpoint conversions for LinearExperts.

A LinearExperts model names its weights like the family's per-expert checkpoints
(`mlp.experts.3.gate_proj.weight`, mixtral `mlp.experts.3.w1.weight`), so per-expert checkpoints load by the
family's stock renamings alone, with no 2D -> 3D -> 2D round trip. Fused checkpoints (`mlp.experts.gate_up_proj`,
what `save_pretrained(save_original_format=False)` writes) are split on load. Saving writes the family's stock
layout: per-expert for families whose stock conversions merge per-expert keys, fused for the others.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import weakref
from typing import Any

import torch
from transformers.core_model_loading import (
    Concatenate,
    ConversionOps,
    Interleave,
    MergeModulelist,
    Transpose,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
)

from ..._hf.conversions import source_patterns, target_patterns
from ..._hf.parallel import local_shard
from ...bundle import BundleOptions, ExpertsFlags, FusedTensor
from .._stock_layout import experts_layout, is_per_expert_merge, stock_experts_layout

_AT_NAME_START = r"(?<![^.])"
_AT_NAME_END = r"(?![^.])"


class SplitFusedExperts(ConversionOps):
    """One stock experts tensor (`tensor` says which and how it is laid out; the stock `[E, 2I, H]` gate_up by
    default) -> one tensor per expert and projection.

    `targets` are per-expert key patterns with `*` for the expert index, one per projection the tensor holds:
    gate_up splits into gate (the first half of its rows, or the even rows where interleaved) and up. Transposed
    weights (`[E, in, out]`) are transposed to nn.Linear's `[out, in]` first; flat ones (`[E * out, in]`, dbrx)
    are viewed per expert. Under tensor parallelism the fused tensor arrives whole (`read_fused_sources_whole`)
    and each piece is cut to this rank's part of the weight it loads into; under expert parallelism only the
    experts this rank holds are made, each a copy, so the fused tensor is freed.
    """

    def __init__(self, targets: tuple[str, ...], tensor: FusedTensor | None = None) -> None:
        self.targets = targets
        self.tensor = tensor or FusedTensor("gate_up_proj", ("gate", "up"))

    @torch.no_grad()
    def convert(
        self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kwargs
    ):
        if len(input_dict) != 1:
            raise ValueError(f"SplitFusedExperts expects one fused tensor, got {sorted(input_dict)}")
        tensor = next(iter(input_dict.values()))
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        spec = self.tensor
        if tensor.dim() != (2 if spec.bias or spec.flat else 3):
            raise ValueError(
                f"SplitFusedExperts expects {spec.name} as {_expected_form(spec)}, got {tuple(tensor.shape)}"
            )
        model, layer_name = kwargs.get("model"), kwargs.get("full_layer_name")
        experts = _experts_module(model, layer_name) if model is not None and layer_name else None
        if spec.flat:
            tensor = tensor.view(experts.num_global_experts, -1, tensor.shape[-1])
        if spec.transposed:
            tensor = tensor.transpose(1, 2)
        count = len(self.targets)
        if spec.interleaved and count > 1:
            parts = [tensor[:, index::count] for index in range(count)]
        else:
            parts = tensor.chunk(count, dim=1)
        held = getattr(experts, "_layerswap_held_experts", None)
        pieces = {}
        for target, part in zip(self.targets, parts, strict=True):
            leaf = target.split("*.", 1)[1]  # the parameter inside one expert: gate_proj.weight
            for expert in range(tensor.shape[0]):
                if held is not None and expert not in held:
                    continue  # held by another rank under expert parallelism
                piece = part[expert]
                if experts is not None:
                    piece = local_shard(experts.get_parameter(f"{expert}.{leaf}"), piece)
                name = target.removeprefix(_AT_NAME_START).replace("*", str(expert))
                pieces[name] = _with_own_storage(piece) if held is None else piece.clone()
        return pieces


def _expected_form(spec: FusedTensor) -> str:
    if spec.bias:
        return "an [E, N] experts bias"
    return "a 2D [E * N, K] experts tensor" if spec.flat else "a 3D [E, N, K] experts tensor"


class _FlattenExperts(ConversionOps):
    """[E, N, K] -> [E * N, K]: saves experts stacked along the first dimension (dbrx's layout)."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        ((key, tensor),) = input_dict.items()
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        return {key: tensor.reshape(-1, tensor.shape[-1])}


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
    accepts a renamed key that the model has, and SplitFusedExperts then names every expert's tensor. Under expert
    parallelism a rank may not hold expert 0: the target is then the first expert it holds, read from the model
    `_hf.conversions` binds the converter to (`_layerswap_bind_model`).
    With `saves_fused`, saving merges the experts back (the family's stock layout is fused); without, saving
    leaves the per-expert keys as they are (the stock layout is per-expert) and the converter is load-only.
    """

    __slots__ = ("_layerswap_model", "per_expert_targets", "saves_fused")

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
        self._layerswap_model: weakref.ref | None = None

    def _layerswap_bind_model(self, model: Any) -> None:
        """The model this converter loads into (weakly): where its experts are split by expert, it names the
        first expert each module holds."""
        self._layerswap_model = weakref.ref(model)

    def rename_source_key(self, source_key: str) -> tuple[str, str | None]:
        renamed, pattern = super().rename_source_key(source_key)
        model = self._layerswap_model() if self._layerswap_model is not None else None
        if pattern is None or model is None:
            return renamed, pattern
        return _first_held_expert(model, renamed), pattern

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
        spec = self.operations[-1].tensor
        operations: list[ConversionOps] = [MergeModulelist(dim=0)]
        if len(self.per_expert_targets) == 2:
            operations.append(Concatenate(dim=1))
            if spec.interleaved:
                operations.append(Interleave(dim=1, inverse=True))
        if spec.transposed:
            operations.append(Transpose(1, 2))
        if spec.flat:
            operations.append(_FlattenExperts())
        operations += [op.reverse_op for op in self.operations[-2::-1]]
        # One merged tensor saves under one key. A stock converter of several sources that yields one tensor (one
        # that dequantizes weight + scales, inkling2_loop's) saves it under the first, the weight's, as stock does.
        reverse = _MergeToFusedExperts(
            source_patterns=list(self.per_expert_targets),
            target_patterns=source_patterns(self)[:1],
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


class _TransposeToStockShape(ConversionOps):
    """A stock `Transpose(check_dims=True)` on a fused experts tensor (qwen3_vl_moe's): it transposes a checkpoint
    tensor unless it already has the model's own fused parameter's shape, which LinearExperts does not have; the
    stock shape LinearExperts records stands in. Stock saves write the model's own shape, so its reverse keeps the
    tensor as it is."""

    def __init__(self, dim0: int, dim1: int, leaf: str) -> None:
        self.dim0, self.dim1, self.leaf = dim0, dim1, leaf

    @torch.no_grad()
    def convert(
        self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kwargs
    ):
        ((key, tensor),) = input_dict.items()
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        expected = _stock_shape(kwargs["model"], kwargs["full_layer_name"], self.leaf)
        if tuple(tensor.shape) != expected:
            tensor = tensor.transpose(self.dim0, self.dim1)
        return {key: tensor}

    @property
    def reverse_op(self) -> ConversionOps:
        return _Unchanged()


class _Unchanged(ConversionOps):
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        return dict(input_dict)

    @property
    def reverse_op(self) -> ConversionOps:
        return self


def _stock_shape(model: Any, layer_name: str, leaf: str) -> tuple[int, ...]:
    """The stock shape of `leaf` (e.g. gate_up_proj) in the swapped experts module `layer_name` lies in."""
    return _experts_module(model, layer_name)._stock_shapes[leaf]


def _experts_module(model: Any, layer_name: str) -> Any:
    """The swapped experts module (a LinearExperts) the key `layer_name` lies in."""
    parts = layer_name.split(".")
    for end in range(len(parts), -1, -1):
        try:
            module = model.get_submodule(".".join(parts[:end]))
        except AttributeError:  # a parameter's name, or a key the model does not have
            continue
        if hasattr(module, "_stock_shapes"):
            return module
    raise ValueError(f"{layer_name} is not in a layerswap experts module")


def _first_held_expert(model: Any, key: str) -> str:
    """`key` (expert 0's weight in an experts module) naming the first expert that module holds on this rank, where
    expert parallelism left it only some; `key` itself otherwise. The key may lack the base model's prefix (a
    checkpoint of the base model loading into one with a head), as transformers adds it later."""
    base = getattr(model, "base_model_prefix", "")
    for added in ("", *([f"{base}."] if base else [])):
        parts = (added + key).split(".")
        for end in range(len(parts) - 1, 0, -1):
            try:
                module = model.get_submodule(".".join(parts[:end]))
            except AttributeError:
                continue
            if not hasattr(module, "_stock_shapes"):  # not the experts module: a module inside it
                continue
            held = getattr(module, "_layerswap_held_experts", None)
            if held is None:
                return key
            return ".".join([*parts[:end], str(held.start), *parts[end + 1 :]]).removeprefix(added)
    return key


def _own_op(op: ConversionOps, leaf: str) -> ConversionOps:
    """A stock op on a fused experts tensor as it runs before the split."""
    if isinstance(op, Transpose) and op.check_dims:
        return _TransposeToStockShape(op.dim0, op.dim1, leaf)
    return op


def _never_matching_renaming() -> WeightRenaming:
    return WeightRenaming(source_patterns=r"(?!)", target_patterns=r"(?!)")


def linear_experts_conversions(
    stock: list[WeightTransform],
    options: BundleOptions,
    family_types: tuple[str, ...] = (),
    tensors: tuple[FusedTensor, ...] | None = None,
) -> list[WeightTransform]:
    """The ConversionEdit of the `-quant` bundles: drop the stock per-expert -> 3D merges (LinearExperts is
    named like per-expert checkpoints already) and load fused checkpoints by splitting them. `family_types`:
    the family's model types, whose stock lists name the per-expert projections where this list merges nothing
    itself (a composite model's text config, whose names only the outer model type's list states). `tensors`:
    the experts' stock parameters, where they are not the stock gate_up_proj and down_proj (biases are split
    too)."""
    tensors = tensors if tensors is not None else ExpertsFlags().tensors()
    layout = experts_layout(stock)
    names = layout.names
    if not layout.per_expert_checkpoints and family_types:
        names = stock_experts_layout(*family_types).names
    kept: list[WeightTransform] = []
    # A stock converter acting on the fused tensor itself (e.g. a transpose) runs before the split.
    fused_ops: dict[str, tuple[str, list[str], list[ConversionOps]]] = {}
    for transform in stock:
        if is_per_expert_merge(transform):
            continue
        targets = target_patterns(transform)
        target = targets[0] if targets else ""
        if isinstance(transform, WeightConverter) and target.endswith(
            tuple(f"experts.{t.name}" for t in tensors)
        ):
            owner, leaf = target.rsplit(".", 1)
            operations = [_own_op(op, leaf) for op in transform.operations]
            fused_ops[leaf] = (owner, source_patterns(transform), operations)
            continue
        kept.append(transform)
    for tensor in tensors:
        prefix = layout.experts_prefix.lstrip(".")
        # Anchored at name boundaries: `experts.down_proj` must match neither `shared_experts.down_proj` nor
        # `experts.down_proj_bias` (transformers 5.15 hands a key to the first converter whose pattern it contains).
        sources = [f"{_AT_NAME_START}{re.escape(prefix)}\\.{re.escape(tensor.name)}{_AT_NAME_END}"]
        pre_ops: list[ConversionOps] = []
        if (
            tensor.name in fused_ops
        ):  # the stock converter's sources; the targets keep the module path it names
            prefix, sources, pre_ops = fused_ops[tensor.name]
        kind = "bias" if tensor.bias else "weight"
        projections = [getattr(names, role) for role in tensor.projections]
        if _stacks_one_tensor_per_projection(sources, pre_ops, tensor):
            # step3p7's checkpoints stack gate and up separately ([E, I, H] each), which the stock converter
            # concatenates: each stack splits into its own projection, and saves back to its own key (a reverse
            # from the joined gate_up would be many-to-many, which transformers refuses).
            parts = [
                (source, dataclasses.replace(tensor, projections=(role,)), name)
                for source, role, name in zip(sources, tensor.projections, projections, strict=True)
            ]
        else:
            parts = [(sources, tensor, None)]
        for part_sources, part, only in parts:
            part_projections = [only] if only else projections
            targets = tuple(f"{_AT_NAME_START}{prefix}.*.{name}.{kind}" for name in part_projections)
            kept.append(
                FusedToLinearExperts(
                    source_patterns=part_sources,
                    target_patterns=f"{prefix}.0.{part_projections[0]}.{kind}",
                    operations=[*([] if only else pre_ops), SplitFusedExperts(targets, part)],
                    per_expert_targets=targets,
                    saves_fused=not layout.per_expert_checkpoints,
                )
            )
    return kept


def _stacks_one_tensor_per_projection(
    sources: list[str], pre_ops: list[ConversionOps], tensor: FusedTensor
) -> bool:
    """The stock converter joins one stacked [E, N, K] tensor per projection along N (Concatenate(dim=1))."""
    return (
        len(tensor.projections) > 1
        and len(sources) == len(tensor.projections)
        and len(pre_ops) == 1
        and isinstance(pre_ops[0], Concatenate)
        and pre_ops[0].dim == 1
        and not tensor.interleaved
    )


def parallel_experts_conversions(
    stock: list[WeightTransform], options: BundleOptions, leaves: tuple[str, ...]
) -> list[WeightTransform]:
    """The ConversionEdit for experts stored one projection per module (jetmoe's JetMoeParallelExperts, `leaves` its
    module names): each `<leaf>.weight [E, out, in]` splits into `<leaf>.<e>.weight` on load and merges back on
    save (the stock checkpoints are fused)."""
    converters = []
    for leaf in leaves:
        source = f"{_AT_NAME_START}{re.escape(leaf)}\\.weight{_AT_NAME_END}"
        target = (f"{_AT_NAME_START}{leaf}.*.weight",)
        converters.append(
            FusedToLinearExperts(
                source_patterns=[source],
                target_patterns=f"{leaf}.0.weight",
                operations=[SplitFusedExperts(target, FusedTensor(f"{leaf}.weight", ("up",)))],
                per_expert_targets=target,
                saves_fused=True,
            )
        )
    return [*stock, *converters]
