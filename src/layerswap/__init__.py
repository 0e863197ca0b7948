"""layerswap: prebuilt module swaps for Hugging Face transformers v5, as named bundles per model family.

import layerswap
layerswap.enable_bundle("qwen2_moe-quant")   # before from_pretrained / from_config
"""

from __future__ import annotations

from ._hf import compat as _compat  # noqa: F401  (checks the installed transformers first)
from ._hf import expert_parallel as _expert_parallel
from ._hf import records as _records
from ._hf import saving as _saving
from .bundle import Bundle, BundleOptions
from .calibration import calibrate_all_experts
from .checkpoints import from_pretrained, recorded_bundles
from .errors import (
    AdapterLayoutError,
    BundleConflictError,
    BundleError,
    CheckpointNeedsBundleError,
    CheckpointShapeError,
    ExpertParallelismError,
    ExpertsImplementationError,
    FusedQKVParallelismError,
    IncompatibleQuantizerError,
    KernelInputError,
    LayerswapWarning,
    MissingExpertWeightsError,
    RoutingMismatchError,
    ShardedSaveError,
    UnknownBundleError,
    UnsupportedTransformersError,
    WeightConversionError,
)
from .peft_adapters import check_adapter, watch_peft
from .registry import (
    apply_bundles,
    disable_bundle,
    enable_bundle,
    enabled_bundles,
    get_bundle,
    list_bundles,
    use_bundle,
)
from .report import Report, report
from .routing import RecordedRouting, record_routing, replay_routing, routing_from_vllm
from .swaps.fast import register_experts_backend, unregister_experts_backend

__version__ = "0.1.0"

_records.watch()  # save_pretrained records the bundles a checkpoint needs; loads without them raise
_expert_parallel.watch()  # a save gathers the experts each rank holds under expert parallelism
_saving.watch()  # a sharded swapped model's save writes nothing unless every rank succeeded
watch_peft()  # PEFT checks every local adapter it loads against the model (peft_adapters.unwatch_peft undoes it)

__all__ = [
    "AdapterLayoutError",
    "Bundle",
    "BundleConflictError",
    "BundleError",
    "BundleOptions",
    "CheckpointNeedsBundleError",
    "CheckpointShapeError",
    "ExpertParallelismError",
    "ExpertsImplementationError",
    "FusedQKVParallelismError",
    "IncompatibleQuantizerError",
    "KernelInputError",
    "LayerswapWarning",
    "MissingExpertWeightsError",
    "RecordedRouting",
    "Report",
    "RoutingMismatchError",
    "ShardedSaveError",
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
    "from_pretrained",
    "get_bundle",
    "list_bundles",
    "record_routing",
    "recorded_bundles",
    "register_experts_backend",
    "replay_routing",
    "report",
    "routing_from_vllm",
    "unregister_experts_backend",
    "use_bundle",
]
