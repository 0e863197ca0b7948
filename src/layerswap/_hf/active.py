"""What the loading hooks know of layerswap's own state: the enabled bundles, as the registry reports them
(`connect`), and the modules a bundle swapped into a model. The hooks never import the registry or a swap."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..bundle import EnabledRecord

_source: Callable[[], tuple[EnabledRecord, ...]] = tuple


def connect(source: Callable[[], tuple[EnabledRecord, ...]]) -> None:
    """Called once by the registry: `source()` gives the enabled bundles, in enable order."""
    global _source
    _source = source


def enabled_records() -> tuple[EnabledRecord, ...]:
    return _source()


def is_swapped(module: nn.Module) -> bool:
    """A module of a class a bundle swapped in (every replacement names the class it replaces)."""
    return hasattr(type(module), "_layerswap_original")


def swapped_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if is_swapped(m)]
