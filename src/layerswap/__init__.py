"""layerswap: prebuilt module swaps for Hugging Face transformers v5, as named bundles per model family.

import layerswap
layerswap.enable_bundle("qwen2_moe-quant")   # before from_pretrained / from_config
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (checks the installed transformers first)
from ._bundle import Bundle, BundleOptions
from ._errors import (
    AdapterLayoutError,
    BundleConflictError,
    BundleError,
    CheckpointShapeError,
    ExpertsImplementationError,
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
    apply_bundles,
    disable_bundle,
    enable_bundle,
    enabled_bundles,
    get_bundle,
    list_bundles,
    use_bundle,
)
from .adapters.fused_experts import register_experts_backend, unregister_experts_backend
from .calibration import calibrate_all_experts
from .peft_adapters import check_adapter
from .report import Report, report
from .routing import RecordedRouting, record_routing, replay_routing, routing_from_vllm

__version__ = "0.1.0"

__all__ = [
    "AdapterLayoutError",
    "Bundle",
    "BundleConflictError",
    "BundleError",
    "BundleOptions",
    "CheckpointShapeError",
    "ExpertsImplementationError",
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
    "apply_bundles",
    "calibrate_all_experts",
    "check_adapter",
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
