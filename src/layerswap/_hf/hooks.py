"""The transformers functions layerswap wraps while at least one bundle is enabled, installed and put back as one
Journal. What each wrapper does is in the module that makes it:

- `patching`: `apply_patches` (exception-safe, cheap, serialised) and `PreTrainedModel.post_init` (models built
  by their constructor);
- `recorders`: `patch_output_recorders` (journaled, stock classes kept recorded; tensor-parallel plans
  rewritten for the swapped modules);
- `loading`: `PreTrainedModel._finalize_model_loading` (no random init of swapped-in weights);
- `quantizers`: `HfQuantizer.get_modules_to_not_convert` and `HfQuantizer.preprocess_model`;
- `conversions`: `get_model_conversion_mapping` and `get_checkpoint_conversion_mapping` (per-model lists);
- `experts`: `PreTrainedModel.set_experts_implementation` (checked against swapped experts).
"""

from __future__ import annotations

import sys
from typing import Any

from transformers import conversion_mapping, modeling_utils
from transformers.modeling_utils import PreTrainedModel
from transformers.quantizers.base import HfQuantizer

from . import conversions, experts, loading, patching, quantizers, recorders
from .journal import Journal

_journal = Journal()


def install() -> None:
    if _journal:
        return
    _wrap(modeling_utils, "apply_patches", patching.make_exception_safe_apply_patches)
    _wrap(modeling_utils, "patch_output_recorders", recorders.make_journaling_patch_output_recorders)
    _wrap(PreTrainedModel, "_finalize_model_loading", loading.make_guarded_finalize)
    _wrap(HfQuantizer, "get_modules_to_not_convert", quantizers.make_skip_aware_modules_to_not_convert)
    _wrap(HfQuantizer, "preprocess_model", quantizers.make_checked_preprocess_model)
    _wrap(
        conversion_mapping,
        "get_checkpoint_conversion_mapping",
        conversions.make_overridable_checkpoint_conversions,
    )
    _wrap(PreTrainedModel, "post_init", patching.make_checked_post_init)
    if "set_experts_implementation" in vars(PreTrainedModel):
        _wrap(PreTrainedModel, "set_experts_implementation", experts.make_checked_set_experts_implementation)
    model_conversions = conversion_mapping.get_model_conversion_mapping
    for module in _modules_binding(model_conversions):
        _wrap(module, "get_model_conversion_mapping", conversions.make_per_model_conversions)


def uninstall() -> None:
    recorders.restore_output_recorders()
    _journal.undo()


def _wrap(owner: Any, attribute: str, make_wrapper: Any) -> None:
    original = vars(owner)[attribute]
    _journal.set_attribute(owner, attribute, make_wrapper(original))


def _modules_binding(function: Any) -> list[Any]:
    """The imported transformers modules that bind `function` by its name (`from x import f`): wrapping it in
    conversion_mapping alone would miss them. A module imported later binds the wrapper, which passes through
    once no bundle is enabled."""
    return [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("transformers")
        and module is not None
        and getattr(module, "__dict__", {}).get(function.__name__) is function
    ]
