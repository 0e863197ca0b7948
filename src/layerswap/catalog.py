"""The bundles: every purpose's builder (`swaps/`) applied to every family row (`families.py`)."""

from __future__ import annotations

from .bundle import Bundle
from .families import FAMILIES
from .swaps import PURPOSES


def _build_catalog() -> dict[str, Bundle]:
    catalog: dict[str, Bundle] = {}
    for family in FAMILIES:
        for build in PURPOSES.values():
            bundle = build(family)
            if bundle is not None:
                catalog[bundle.name] = bundle
    return dict(sorted(catalog.items()))


CATALOG: dict[str, Bundle] = _build_catalog()
