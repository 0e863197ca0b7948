"""layerswap: prebuilt module swaps for Hugging Face transformers v5, as named bundles per model family.

import layerswap
layerswap.enable_bundle("qwen2_moe-quant")   # before from_pretrained / from_config
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (checks the installed transformers first)
from ._bundle import Bundle, BundleOptions
from ._errors import (
    BundleConflictError,
    BundleError,
    FusedQKVParallelismError,
    IncompatibleQuantizerError,
    LayerswapWarning,
    MissingExpertWeightsError,
    RoutingMismatchError,
    UnknownBundleError,
    UnsupportedTransformersError,
    WeightConversionError,
)
from ._registry import (
    disable_bundle,
    enable_bundle,
    enabled_bundles,
    get_bundle,
    list_bundles,
    use_bundle,
)
from .adapters.fused_experts import register_experts_backend, unregister_experts_backend
from .calibration import calibrate_all_experts
from .report import Report, report
from .routing import RecordedRouting, record_routing, replay_routing, routing_from_vllm

__version__ = "0.1.0"

__all__ = [
    "Bundle",
    "BundleConflictError",
    "BundleError",
    "BundleOptions",
    "FusedQKVParallelismError",
    "IncompatibleQuantizerError",
    "LayerswapWarning",
    "MissingExpertWeightsError",
    "RecordedRouting",
    "Report",
    "RoutingMismatchError",
    "UnknownBundleError",
    "UnsupportedTransformersError",
    "WeightConversionError",
    "__version__",
    "calibrate_all_experts",
    "disable_bundle",
    "enable_bundle",
    "enabled_bundles",
    "get_bundle",
    "list_bundles",
    "record_routing",
    "register_experts_backend",
    "replay_routing",
    "report",
    "routing_from_vllm",
    "unregister_experts_backend",
    "use_bundle",
]
