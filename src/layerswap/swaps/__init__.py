"""The swaps, one package per purpose: `swaps/<purpose>/` holds the replacement modules (`modules.py`), the
checkpoint conversions that make them load and save (`conversion.py`, where there are any) and `build(family)`,
which returns the purpose's bundle for a family row (None for a family it does not serve).

Adding a purpose is adding its package: every package here is one, found when this package is imported.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

from ..bundle import Bundle, Family

Builder = Callable[[Family], "Bundle | None"]


def _discover() -> dict[str, Builder]:
    purposes: dict[str, Builder] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        if not info.ispkg or info.name.startswith("_"):
            continue
        package = importlib.import_module(f"{__name__}.{info.name}")
        build = getattr(package, "build", None)
        if not callable(build):
            raise ImportError(f"{package.__name__} is a purpose package without a build(family) function")
        purposes[info.name] = build
    return purposes


# purpose name -> its bundle builder.
PURPOSES: dict[str, Builder] = _discover()
