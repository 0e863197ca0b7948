"""layerswap: prebuilt module swaps for Hugging Face transformers v5, as named bundles per model family.

    import layerswap
    layerswap.enable_bundle("qwen2_moe-quant")   # before from_pretrained / from_config
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (checks the installed transformers first)
from ._bundle import Bundle, BundleOptions
from ._errors import BundleError, LayerswapWarning, RoutingMismatchError
from ._registry import (
    disable_bundle,
    enable_bundle,
    enabled_bundles,
    get_bundle,
    list_bundles,
    use_bundle,
)
from .calibration import calibrate_all_experts
from .report import Report, report
from .routing import RecordedRouting, record_routing, replay_routing, routing_from_vllm

__version__ = "0.1.0"

__all__ = [
    "Bundle",
    "BundleError",
    "BundleOptions",
    "LayerswapWarning",
    "RecordedRouting",
    "Report",
    "RoutingMismatchError",
    "__version__",
    "calibrate_all_experts",
    "disable_bundle",
    "enable_bundle",
    "enabled_bundles",
    "get_bundle",
    "list_bundles",
    "record_routing",
    "replay_routing",
    "report",
    "routing_from_vllm",
    "use_bundle",
]
