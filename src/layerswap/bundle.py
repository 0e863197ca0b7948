"""The bundle data model, as frozen data: a model family, what a bundle swaps, converts and keeps unquantized,
and what an enabled bundle registered. Everything above imports this; it imports only the errors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import nn
from transformers.core_model_loading import WeightTransform

from .errors import BundleError

# Builds the replacement class from the transformers class it replaces and the bundle's options.
AdapterFactory = Callable[[type[nn.Module], "BundleOptions"], type[nn.Module]]
# Changes some other transformers state (a class attribute, an interface entry) and returns the function that
# puts back exactly what it changed. Runs on enable; the returned function runs on disable.
Installer = Callable[["BundleOptions"], Callable[[], None]]
# Rewrites a model type's checkpoint conversion list (stock, or as earlier bundles left it) for this bundle.
ConversionEdit = Callable[[list[WeightTransform], "BundleOptions"], list[WeightTransform]]


@dataclass(frozen=True)
class BundleOptions:
    """Options every bundle accepts.

    keep_unquantized: module-name suffixes that quantizers must leave in full precision. ``None`` means the
    bundle's default (routers and 1-wide gates); ``()`` quantizes everything the quantizer can.
    """

    keep_unquantized: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.keep_unquantized is not None:
            if isinstance(self.keep_unquantized, str) or not all(
                isinstance(s, str) and s for s in self.keep_unquantized
            ):
                raise TypeError(
                    f"keep_unquantized must be a tuple of module-name suffixes such as ('mlp.gate',), "
                    f"got {self.keep_unquantized!r}"
                )
            object.__setattr__(self, "keep_unquantized", tuple(self.keep_unquantized))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True)
class Patch:
    """Replace the transformers class `class_name` (defined in `module`) by `adapter(original, options)`."""

    module: str
    class_name: str
    adapter: AdapterFactory


@dataclass(frozen=True)
class Bundle:
    """A named set of module swaps and checkpoint conversions for one or more transformers model types."""

    name: str
    purpose: str
    model_types: tuple[str, ...]
    description: str
    patches: tuple[Patch, ...] = ()
    conversions: Mapping[str, ConversionEdit] = field(default_factory=dict)
    keep_unquantized: tuple[str, ...] = ()
    installers: tuple[Installer, ...] = ()
    # Kinds of transformers internal the bundle needs beyond what every bundle needs (keys of _hf.compat.KINDS):
    # enable_bundle refuses it, and `layerswap list` marks it, where the installed transformers lacks one.
    needs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "conversions", MappingProxyType(dict(self.conversions)))

    @classmethod
    def for_family(cls, family: Family, purpose: str, description: str, **fields: Any) -> Bundle:
        """The bundle `<model_type>-<purpose>` for `family`, keeping what the family keeps unquantized."""
        fields.setdefault("keep_unquantized", family.keep_unquantized)
        return cls(
            name=f"{family.model_type}-{purpose}",
            purpose=purpose,
            model_types=family.model_types,
            description=description,
            **fields,
        )

    def make_options(self, options: dict[str, Any]) -> BundleOptions:
        unknown = sorted(set(options) - set(BundleOptions.field_names()))
        if unknown:
            raise BundleError(
                f"Bundle {self.name!r} got unknown option(s) {unknown}; it accepts "
                f"{list(BundleOptions.field_names())}."
            )
        try:
            return BundleOptions(**options)
        except (TypeError, ValueError) as error:
            raise BundleError(f"Bundle {self.name!r}: invalid options {options}: {error}") from error


@dataclass(frozen=True)
class EnabledRecord:
    """An enabled bundle as the registry tells the loading hooks: its options and the classes it registered."""

    bundle: Bundle
    options: BundleOptions
    replacements: frozenset[type[nn.Module]]


# Routers and 1-wide gates (e.g. qwen2_moe's shared_expert_gate, an nn.Linear(H, 1)) stay in full precision by
# default, as llm-compressor does: they are tiny, routing is sensitive to them, and bitsandbytes' CPU kernels
# reject 1-wide outputs. Suffixes of module names; override with enable_bundle(..., keep_unquantized=(...)).
DEFAULT_KEEP_UNQUANTIZED = ("gate", "router", "shared_expert_gate")


@dataclass(frozen=True)
class ExpertsFlags:
    """How a stock Experts class stores its experts: the layout arguments of `@use_experts_implementation`, with
    their defaults (the stock fused layout: gate_up_proj [E, 2I, H], gate rows first, down_proj [E, H, I])."""

    has_gate: bool = True  # gate_up_proj, else up_proj alone (act(up), then down)
    has_bias: bool = False  # gate_up_proj_bias [E, 2I] (up_proj_bias) and down_proj_bias [E, H]
    is_transposed: bool = False  # weights stored [E, in, out]
    is_concatenated: bool = True  # gate rows then up rows; else interleaved (gate0, up0, gate1, up1, ...)
    has_post_expert_norm: bool = (
        False  # a norm (`post_expert_norm`) on each expert's output, before its weight
    )

    @classmethod
    def of(cls, declared: Mapping[str, Any]) -> ExpertsFlags:
        """From the flags a class declares (or a module carries); flags this dataclass does not know are the
        caller's to refuse."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in declared.items() if k in names})

    @property
    def is_stock(self) -> bool:
        return self == ExpertsFlags()

    def tensors(self) -> tuple[FusedTensor, ...]:
        """The stock parameters this layout has, and the per-expert projections each one holds."""
        up = FusedTensor("gate_up_proj", ("gate", "up")) if self.has_gate else FusedTensor("up_proj", ("up",))
        weights = (up, FusedTensor("down_proj", ("down",)))
        weights = tuple(
            dataclasses.replace(t, transposed=self.is_transposed, interleaved=not self.is_concatenated)
            for t in weights
        )
        biases = tuple(
            dataclasses.replace(t, name=f"{t.name}_bias", bias=True, transposed=False) for t in weights
        )
        return weights + (biases if self.has_bias else ())


@dataclass(frozen=True)
class FusedTensor:
    """One stock experts parameter and the per-expert nn.Linear tensors it holds."""

    name: str  # its name under the experts module: "gate_up_proj", "down_proj_bias", "mlp.w1" (dbrx)
    projections: tuple[str, ...]  # the roles it holds, in order: ("gate", "up"), ("down",)
    bias: bool = False  # [E, out] biases, else [E, out, in] weights
    transposed: bool = False  # weights stored [E, in, out]
    interleaved: bool = (
        False  # two projections' rows alternate (gate0, up0, gate1, ...), else one after the other
    )
    flat: bool = False  # experts stacked along the first dimension: [E * out, in] (transposed: [E * in, out])


@dataclass(frozen=True)
class Family:
    """One transformers model type and the names of the classes layerswap replaces in it."""

    model_type: str
    experts: str | None = None  # Experts class with the stock fused layout; None for dense families
    router: str | None = None  # MoE router class
    attention: str | None = None  # attention class with separate q_proj / k_proj / v_proj
    module: str | None = None  # defaults to transformers.models.<model_type>.modeling_<model_type>
    keep_unquantized: tuple[str, ...] = DEFAULT_KEEP_UNQUANTIZED
    own_gate: bool = (
        False  # the experts compute their own gate (`_apply_gate`): no fused-kernel ('-fast') bundle
    )
    # A composite (vision-language, omni) model's other stock-layout Experts classes (qwen3_omni_moe's talker) and
    # the model types of its sub-configs (the text model's, the towers'): the bundles edit the checkpoint
    # conversions of each, since a sub-model is loaded by the conversions of its own model type.
    more_experts: tuple[str, ...] = ()
    sub_model_types: tuple[str, ...] = ()
    # Model classes of the family with conversions of their own, which transformers looks up by class name
    # before the model type (unlimited_ocr's UnlimitedOcrTextModel merges the per-expert checkpoint's experts).
    conversion_classes: tuple[str, ...] = ()
    # The experts' layout where it is not the stock one (gpt_oss: transposed, biased, gate/up interleaved), and
    # for a class `@use_experts_implementation` cannot describe (dbrx), its stock parameters one by one.
    flags: ExpertsFlags = ExpertsFlags()
    tensors: tuple[FusedTensor, ...] | None = None

    @property
    def fused_tensors(self) -> tuple[FusedTensor, ...]:
        return self.tensors if self.tensors is not None else self.flags.tensors()

    @property
    def is_stock_layout(self) -> bool:
        """The experts have the stock fused layout (what the fused kernels of '-fast' compute on)."""
        return self.flags.is_stock and self.tensors is None

    @property
    def model_types(self) -> tuple[str, ...]:
        return (self.model_type, *self.sub_model_types)

    @property
    def conversion_keys(self) -> tuple[str, ...]:
        """Every key transformers looks the family's checkpoint conversions up by: model classes, model types."""
        return (*self.conversion_classes, *self.model_types)

    @property
    def all_experts(self) -> tuple[str, ...]:
        return (self.experts, *self.more_experts) if self.experts else ()

    @property
    def modeling_module(self) -> str:
        return self.module or f"transformers.models.{self.model_type}.modeling_{self.model_type}"
