"""layerswap: prebuilt module swaps for Hugging Face transformers v5, as named bundles per model family.

    import layerswap
    layerswap.enable_bundle("qwen2_moe-quant")   # before from_pretrained / from_config
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (checks the installed transformers first)
from ._bundle import Bundle, BundleOptions
from ._errors import BundleError, LayerswapWarning
from ._registry import (
    disable_bundle,
    enable_bundle,
    enabled_bundles,
    get_bundle,
    list_bundles,
    use_bundle,
)
from .report import Report, report

__version__ = "0.1.0"

__all__ = [
    "Bundle",
    "BundleError",
    "BundleOptions",
    "LayerswapWarning",
    "Report",
    "__version__",
    "disable_bundle",
    "enable_bundle",
    "enabled_bundles",
    "get_bundle",
    "list_bundles",
    "report",
    "use_bundle",
]
