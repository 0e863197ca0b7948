"""The bundle data model: what a bundle swaps, converts and keeps unquantized, declared as frozen data."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import nn
from transformers.core_model_loading import WeightTransform

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
    requirements: tuple[str, ...] = ()
    options_type: type[BundleOptions] = BundleOptions

    def __post_init__(self) -> None:
        object.__setattr__(self, "conversions", MappingProxyType(dict(self.conversions)))

    @property
    def families(self) -> tuple[str, ...]:
        return self.model_types

    def make_options(self, options: dict[str, Any]) -> BundleOptions:
        from ._errors import BundleError

        unknown = sorted(set(options) - set(self.options_type.field_names()))
        if unknown:
            raise BundleError(
                f"Bundle {self.name!r} got unknown option(s) {unknown}; it accepts "
                f"{list(self.options_type.field_names())}."
            )
        try:
            return self.options_type(**options)
        except (TypeError, ValueError) as error:
            raise BundleError(f"Bundle {self.name!r}: invalid options {options}: {error}") from error
