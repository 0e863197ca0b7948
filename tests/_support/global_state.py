"""A deep, comparable picture of every piece of transformers state that layerswap may change."""

from __future__ import annotations

import sys
from typing import Any

from transformers import conversion_mapping, modeling_utils, monkey_patching
from transformers.distributed.mixin import DistributedMixin
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.modeling_utils import PreTrainedModel
from transformers.quantizers.base import HfQuantizer
from transformers.utils.output_capturing import OutputRecorder


def _recorder_picture(value: Any) -> Any:
    if isinstance(value, list):
        return [_recorder_picture(v) for v in value]
    if isinstance(value, OutputRecorder):
        return (
            "OutputRecorder",
            _class_picture(value.target_class),
            value.index,
            value.layer_name,
            value.class_name,
        )
    return ("plain", _class_picture(value) if isinstance(value, type) else value)


def _class_picture(cls: Any) -> Any:
    if cls is None:
        return None
    if isinstance(cls, tuple):  # a recorder may target several classes (inkling2_loop's)
        return tuple(_class_picture(c) for c in cls)
    # A layerswap class left in a recorder after disable is a leak even in a module first imported by the test.
    return (
        "LAYERSWAP LEAK" if hasattr(cls, "_layerswap_original") else "",
        cls.__module__,
        cls.__qualname__,
        id(cls),
    )


def _output_recorders() -> dict[str, Any]:
    picture = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or module is None:
            continue
        for attribute, value in list(vars(module).items()):
            if isinstance(value, type) and "_can_record_outputs" in vars(value):
                recorders = vars(value)["_can_record_outputs"]
                if isinstance(recorders, dict):
                    picture[f"{name}.{attribute}"] = {k: _recorder_picture(v) for k, v in recorders.items()}
    return picture


def _model_conversion_bindings() -> dict[str, Any]:
    return {
        name: vars(module)["get_model_conversion_mapping"]
        for name, module in list(sys.modules.items())
        if name.startswith("transformers")
        and "get_model_conversion_mapping" in getattr(module, "__dict__", {})
    }


def global_state() -> dict[str, Any]:
    conversion_mapping.get_checkpoint_conversion_mapping("llama")
    cache = conversion_mapping._checkpoint_conversion_mapping_cache
    return {
        "patch_mapping": dict(monkey_patching.get_patch_mapping()),
        "conversion_entries": {key: id(value) for key, value in cache.items()},
        "user_registered": set(conversion_mapping.USER_REGISTERED_MAPPINGS),
        "output_recorders": _output_recorders(),
        "patch_output_recorders": modeling_utils.patch_output_recorders,
        "apply_patches": modeling_utils.apply_patches,
        "finalize": PreTrainedModel.__dict__["_finalize_model_loading"],
        "modules_to_not_convert": HfQuantizer.__dict__["get_modules_to_not_convert"],
        "preprocess_model": HfQuantizer.__dict__["preprocess_model"],
        "experts_functions": dict(ALL_EXPERTS_FUNCTIONS._global_mapping),
        "experts_functions_local": dict(ALL_EXPERTS_FUNCTIONS._local_mapping),
        "resolve_parallel_plans": DistributedMixin.__dict__.get("_resolve_parallel_plans"),
        "shard_on_read": _shard_on_read(),
        "expert_parallel_dispatch": _expert_parallel_dispatch(),
        "checkpoint_conversions": conversion_mapping.get_checkpoint_conversion_mapping,
        "set_experts_implementation": PreTrainedModel.__dict__.get("set_experts_implementation"),
        "post_init": PreTrainedModel.__dict__["post_init"],
        "model_conversions": _model_conversion_bindings(),
    }


def _shard_on_read() -> Any:
    try:
        from transformers.distributed.sharding_utils import DtensorShardOperation
    except ImportError:
        return None
    return DtensorShardOperation.__dict__.get("shard_tensor")


def _expert_parallel_dispatch() -> Any:
    try:
        from transformers.distributed.expert_parallel import EpDispatchExpertsParallel
    except ImportError:
        return None
    return EpDispatchExpertsParallel.__dict__.get("install_forward")


def comparable(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """`after`, less the recorder classes of modules first imported after `before` was taken (they cannot have
    a 'before'; their leaks still show, as 'LAYERSWAP LEAK' entries, through leaked_recorders)."""
    after = dict(after)
    after["output_recorders"] = {
        k: v for k, v in after["output_recorders"].items() if k in before["output_recorders"]
    }
    after["model_conversions"] = {
        k: v for k, v in after["model_conversions"].items() if k in before["model_conversions"]
    }
    return after


def leaked_recorders(state: dict[str, Any]) -> list[str]:
    return [name for name, picture in state["output_recorders"].items() if "LAYERSWAP LEAK" in repr(picture)]


def describe_difference(before: dict[str, Any], after: dict[str, Any]) -> str:
    lines = []
    for key in before:
        if before[key] != after[key]:
            if isinstance(before[key], dict):
                changed = sorted(
                    k for k in set(before[key]) | set(after[key]) if before[key].get(k) != after[key].get(k)
                )
                lines.append(f"{key}: {changed[:8]}")
            else:
                lines.append(f"{key}: {before[key]!r} -> {after[key]!r}")
    return "; ".join(lines)


def assert_wrapper_shared_and_restored(owner: type, attribute: str, bundles: tuple[str, str]) -> None:
    """Two bundles that each need `owner.attribute` wrapped share one wrapper, which stays while either is enabled
    and goes when the last is disabled, leaving the original exactly."""
    import layerswap

    original = owner.__dict__[attribute]
    first, second = bundles
    layerswap.enable_bundle(first)
    layerswap.enable_bundle(second)
    wrapped = owner.__dict__[attribute]
    assert wrapped is not original
    layerswap.disable_bundle(first)  # not the last one in: the wrapper stays
    assert owner.__dict__[attribute] is wrapped
    layerswap.disable_bundle(second)
    assert owner.__dict__[attribute] is original
