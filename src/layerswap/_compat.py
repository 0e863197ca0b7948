"""Fail at import, with a clear message, when transformers lacks an internal layerswap relies on."""

from __future__ import annotations

import importlib

import transformers

TRANSFORMERS_VERSION: str = transformers.__version__

# (module, attribute) pairs that layerswap reads, wraps or restores. Each entry is checked once at import:
# a missing one means this transformers release predates (or has redesigned) the mechanism.
_REQUIRED_INTERNALS: tuple[tuple[str, str], ...] = (
    ("transformers.monkey_patching", "register_patch_mapping"),
    ("transformers.monkey_patching", "unregister_patch_mapping"),
    ("transformers.monkey_patching", "get_patch_mapping"),
    ("transformers.monkey_patching", "patch_output_recorders"),
    ("transformers.modeling_utils", "patch_output_recorders"),
    ("transformers.conversion_mapping", "register_checkpoint_conversion_mapping"),
    ("transformers.conversion_mapping", "get_checkpoint_conversion_mapping"),
    ("transformers.conversion_mapping", "USER_REGISTERED_MAPPINGS"),
    ("transformers.core_model_loading", "WeightConverter"),
    ("transformers.core_model_loading", "WeightRenaming"),
    ("transformers.core_model_loading", "ConversionOps"),
    ("transformers.core_model_loading", "MergeModulelist"),
    ("transformers.core_model_loading", "Concatenate"),
    ("transformers.modeling_utils", "PreTrainedModel"),
    ("transformers.quantizers.base", "HfQuantizer"),
    ("transformers.integrations.moe", "ALL_EXPERTS_FUNCTIONS"),
)


def check_transformers() -> None:
    missing = []
    for module_name, attribute in _REQUIRED_INTERNALS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(f"{module_name} (module)")
            continue
        if not hasattr(module, attribute):
            missing.append(f"{module_name}.{attribute}")
    from transformers.modeling_utils import PreTrainedModel

    if not hasattr(PreTrainedModel, "_finalize_model_loading"):
        missing.append("transformers.modeling_utils.PreTrainedModel._finalize_model_loading")
    if missing:
        raise ImportError(
            f"layerswap needs transformers >= 5.3 (tested on 5.24); the installed transformers "
            f"{TRANSFORMERS_VERSION} lacks: {', '.join(missing)}. "
            "Upgrade with `pip install -U 'transformers>=5.24,<6'`."
        )


check_transformers()
