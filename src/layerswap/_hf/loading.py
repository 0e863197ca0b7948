"""The load guard around `PreTrainedModel._finalize_model_loading`, which would give swapped-in modules whose
weights the checkpoint lacks a random init.

Before it runs: the checkpoint tensors of experts other ranks hold under expert parallelism are not unexpected; a
checkpoint tensor of a swapped module with another shape raises CheckpointShapeError, one that
tensor parallelism cut wrongly the module's own error (`_layerswap_check_checkpoint_keys`), missing
weights MissingExpertWeightsError (WeightConversionError when the quantizer failed on weights the checkpoint has).
After: a warning when a bundle swapped nothing, and after a quantized load, the quantized swapped-in layers keep
saving as they are and the heap is trimmed.
"""

from __future__ import annotations

import glob
import os
import re
import warnings
from typing import Any

from torch import nn

from ..errors import CheckpointShapeError, LayerswapWarning, MissingExpertWeightsError, WeightConversionError
from ..quantized import is_quantized_linear
from . import quantizers
from .active import enabled_records, is_swapped, swapped_modules
from .expert_parallel import forget_keys_held_elsewhere
from .records import check_recorded_bundles

# How a conversion op's CheckpointShapeError reads in transformers' record of it (a traceback's last line).
_SHAPE_ERROR = f"{CheckpointShapeError.__module__}.{CheckpointShapeError.__qualname__}: "


def make_guarded_finalize(original: staticmethod) -> staticmethod:
    finalize = original.__func__

    def _finalize_model_loading(model: Any, load_config: Any, loading_info: Any) -> Any:
        swapped = swapped_modules(model)  # one walk of the module tree for every check below
        # Under expert parallelism, the experts other ranks hold are theirs to load.
        forget_keys_held_elsewhere(swapped, loading_info)
        # A checkpoint saved under bundles not in force: that error first, it names the bundles to enable.
        check_recorded_bundles(model, load_config, loading_info)
        _raise_on_wrong_shaped_swapped_weights(swapped, load_config, loading_info)
        _check_checkpoint_keys(swapped, load_config)
        if not _loads_no_weights_at_all(model, load_config, loading_info):
            _raise_on_missing_swapped_weights(model, swapped, load_config, loading_info)
        result = finalize(model, load_config, loading_info)
        _warn_on_bundles_that_swapped_nothing(model, swapped)
        if getattr(load_config, "hf_quantizer", None) is not None and swapped:
            _save_quantized_layers_as_loaded(model, swapped)
            quantizers.trim_heap()  # looked up here, so tests can count the calls
        return result

    return staticmethod(_finalize_model_loading)


def _save_quantized_layers_as_loaded(model: nn.Module, swapped: list[tuple[str, nn.Module]]) -> None:
    """Quantized weights cannot be re-laid-out on save: bitsandbytes' packed 4-bit weights come with per-layer quant
    states, int8 ones with per-row scales. They can be neither stacked (experts into granitemoe's fused
    `[E, 2I, H]`) nor split (a fused `qkv_proj` into q/k/v). So a quantized model saves the layers layerswap swapped
    in as they are (experts one by one, one `qkv_proj`), and the same bundle loads them back. Stock transformers
    loads quantized experts in no layout at all."""
    kept_as_loaded: set[type] = set()
    for _, module in swapped:
        # A swapped module that re-lays its weights out on save names the conversions to skip once quantized.
        kept = getattr(module, "_layerswap_conversions_kept_when_quantized", None)
        if kept is not None:
            kept_as_loaded.update(kept())
    conversions = getattr(model, "_weight_conversions", None)
    if kept_as_loaded and conversions:
        model._weight_conversions = [c for c in conversions if type(c) not in kept_as_loaded]


def _raise_on_wrong_shaped_swapped_weights(
    swapped: list[tuple[str, nn.Module]], load_config: Any, loading_info: Any
) -> None:
    """A checkpoint tensor of a swapped module with another shape is named, with both shapes, in the exception
    (transformers names it only in its logged load report): one transformers recorded as mismatched, or one that a
    '-fast' bundle's checked per-expert merge refused (stock would report the stacked weight as missing)."""
    prefixes = tuple(name + "." for name, _ in swapped)
    if not prefixes:
        return
    source = getattr(load_config, "pretrained_model_name_or_path", None) or "the checkpoint"
    errors: dict[str, str] = getattr(loading_info, "conversion_errors", None) or {}
    for key, text in sorted(errors.items()):
        _, error = _summarize_conversion_error(text)
        if key.startswith(prefixes) and error.startswith(_SHAPE_ERROR):
            raise CheckpointShapeError(
                f"{source} has weights of modules layerswap swapped in with the wrong shape: "
                f"{error.split(': ', 1)[-1]}. The checkpoint is of another configuration of this model (or "
                "damaged); load it with its own config.json."
            )
    if getattr(load_config, "ignore_mismatched_sizes", False):
        return
    mismatched = sorted(
        (key, tuple(found), tuple(expected))
        for key, found, expected in getattr(loading_info, "mismatched_keys", ())
        if key.startswith(prefixes)
    )
    if mismatched:
        shown = "; ".join(
            f"{key}: {found} in the checkpoint, {expected} in the model"
            for key, found, expected in mismatched[:6]
        )
        more = f"; and {len(mismatched) - 6} more" if len(mismatched) > 6 else ""
        raise CheckpointShapeError(
            f"{source} has {len(mismatched)} weight(s) of modules layerswap swapped in with another shape than "
            f"the model: {shown}{more}. The checkpoint is of another configuration of this model: load it with "
            "its own config.json, or pass ignore_mismatched_sizes=True to from_pretrained to initialise those "
            "weights randomly on purpose."
        )


def _check_checkpoint_keys(swapped: list[tuple[str, nn.Module]], load_config: Any) -> None:
    """Let each swapped module that asks (`_layerswap_check_checkpoint_keys(name, keys)`, which returns whether it
    needs the keys at all, then raises on them) see the checkpoint's tensor names: a fused attention sharded by
    tensor parallelism refuses a checkpoint that holds qkv_proj fused. The names are read only for such a
    module."""
    asking = [(name, m) for name, m in swapped if getattr(m, "_layerswap_check_checkpoint_keys", None)]
    asking = [(name, m) for name, m in asking if m._layerswap_check_checkpoint_keys(name, None)]
    if not asking:
        return
    keys = _checkpoint_keys(load_config)
    for name, module in asking:
        module._layerswap_check_checkpoint_keys(name, keys)


def _checkpoint_keys(load_config: Any) -> frozenset[str]:
    """The tensor names of the checkpoint being loaded: the index's, or a local folder's safetensors files'."""
    metadata = getattr(load_config, "sharded_metadata", None) or {}
    if metadata.get("all_checkpoint_keys"):
        return frozenset(metadata["all_checkpoint_keys"])
    source = getattr(load_config, "pretrained_model_name_or_path", None)
    if source is None or not os.path.isdir(source):
        return frozenset()
    from safetensors import safe_open

    keys: set[str] = set()
    for path in sorted(glob.glob(os.path.join(source, "*.safetensors"))):
        with safe_open(path, "pt") as checkpoint:
            keys.update(checkpoint.keys())
    return frozenset(keys)


def _loads_no_weights_at_all(model: nn.Module, load_config: Any, loading_info: Any) -> bool:
    """`from_pretrained(None, config=..., state_dict={})`, transformers' way to build a model and initialise every
    weight, is no checkpoint lacking some: no source, nothing unexpected, every parameter missing."""
    if (
        getattr(load_config, "pretrained_model_name_or_path", None) is not None
        or loading_info.unexpected_keys
    ):
        return False
    return all(name in loading_info.missing_keys for name, _ in model.named_parameters())


def _raise_on_missing_swapped_weights(
    model: nn.Module, swapped: list[tuple[str, nn.Module]], load_config: Any, loading_info: Any
) -> None:
    prefixes = [name + "." for name, module in swapped if getattr(module, "_layerswap_strict", False)]
    if not prefixes:
        return
    # A weight tied to one the checkpoint has is not missing: finalizing ties it (diffusion_gemma's encoder
    # experts are its decoder's, and a checkpoint holds them once).
    swapped_missing = [k for k in loading_info.missing_keys if any(k.startswith(p) for p in prefixes)]
    if not swapped_missing:
        return
    tied = _tied_weights(model)  # expands the model's tie patterns over every parameter: only when needed
    missing = sorted(k for k in swapped_missing if k not in tied or tied[k] in loading_info.missing_keys)
    if not missing:
        return
    shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
    source = getattr(load_config, "pretrained_model_name_or_path", "the checkpoint")
    conversion_note = _raise_on_failed_quantization(prefixes, missing, source, load_config, loading_info)
    if any(".experts." in key for key in missing):
        layouts = "per-expert keys like 'mlp.experts.0.gate_proj.weight' or fused 'mlp.experts.gate_up_proj'"
    else:
        layouts = "separate 'self_attn.q_proj/k_proj/v_proj' or fused 'self_attn.qkv_proj' weights"
    raise MissingExpertWeightsError(
        f"{source} lacks {len(missing)} weight(s) of modules that layerswap swapped in: {shown}. Loading "
        "would leave them randomly initialised. Check that the checkpoint is complete and of this model "
        f"family ({layouts}); to start from random weights on purpose, use from_config instead of from_pretrained."
        f"{conversion_note}"
    )


def _tied_weights(model: nn.Module) -> dict[str, str]:
    """Every tied parameter of `model` and the one it is tied to, sub-models' included."""
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    return expand(all_submodels=True) if expand is not None else {}


def _raise_on_failed_quantization(
    prefixes: list[str], missing: list[str], source: str, load_config: Any, loading_info: Any
) -> str:
    """Missing weights may be weights the checkpoint has: when an op raises on a group of weights, transformers
    records the op's error in `loading_info.conversion_errors` (keyed by the group's first target weight) and
    skips the whole group, which then counts as missing. When the quantizer's op failed, raise its error (the
    checkpoint is complete). Any other op's error (layerswap's conversions raise on weights the checkpoint lacks)
    is returned as a note for the missing-weights error."""
    errors: dict[str, str] = getattr(loading_info, "conversion_errors", None) or {}
    failed = {key: text for key, text in errors.items() if any(key.startswith(p) for p in prefixes)}
    if not failed:
        return ""
    first_key, first_text = min(failed.items())
    op_name, error = _summarize_conversion_error(first_text)
    quantizer = getattr(load_config, "hf_quantizer", None)
    if quantizer is None or op_name is None or op_name != _quantize_op_name(quantizer):
        return f" While loading, {op_name or 'a conversion op'} on {first_key} raised {error}."
    failed_prefixes = [p for p in prefixes if any(key.startswith(p) for key in failed)]
    explained = [key for key in missing if any(key.startswith(p) for p in failed_prefixes)]
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    method = getattr(method, "value", method) or type(quantizer).__name__
    raise WeightConversionError(
        f"{source} has the weights of the modules layerswap swapped in (the checkpoint is complete), but the "
        f"{method} quantizer failed on them while loading: {op_name} on {first_key} raised {error}. transformers "
        f"skipped every weight its quantize op failed on, so {len(explained)} weight(s) of modules layerswap "
        f"swapped in would be left randomly initialised ({len(failed)} failed op call(s) under them, {len(errors)} "
        "in the whole load). Stock transformers fails the same load ('issues during automatic conversion of the "
        f"weights'). Fix what the quantizer reports (a {method} configuration its kernels support on this device, "
        "or the package it asks for), or load without quantization_config."
    )


def _summarize_conversion_error(text: str) -> tuple[str | None, str]:
    """(op class name, 'ExceptionType: message') from a `conversion_errors` entry, which transformers writes as
    the formatted traceback, then the message, then 'Error: <Op> on tensors destined for ...' (5.x)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    op_name = None
    for line in reversed(lines):
        match = re.match(r"Error(?: via)?:? (\w+)", line)
        if match:
            op_name = match.group(1)
            break
    exception = [line for line in lines if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Warning|Exit): ", line)]
    if exception:
        return op_name, exception[-1].strip()
    plain = [line for line in lines if not line.startswith((" ", "Traceback", "Error"))]
    return op_name, (plain[-1].strip() if plain else lines[-1].strip() if lines else "an unknown error")


def _quantize_op_name(quantizer: Any) -> str | None:
    try:
        return type(quantizer.get_quantize_ops()).__name__
    except Exception:  # a quantizer without quantize ops, or one that cannot build them here
        return None


def _warn_on_bundles_that_swapped_nothing(model: nn.Module, swapped: list[tuple[str, nn.Module]]) -> None:
    """Warn when no enabled bundle swapped anything (the wrong family was loaded), or when a bundle made for this
    model's type swapped nothing (its classes are not the ones this model uses: another tool, such as Defuser,
    replaced them first, or the model is of another family)."""
    swapped_classes = {type(m) for _, m in swapped}
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    records = [(record.bundle, record.replacements) for record in enabled_records() if record.replacements]
    idle = [(bundle, replacements) for bundle, replacements in records if not swapped_classes & replacements]
    if not records or not idle:
        return
    nothing_swapped = len(idle) == len(records)
    for bundle, replacements in idle:
        if not (nothing_swapped or model_type in bundle.model_types):
            continue
        stock = sorted({r._layerswap_original.__name__ for r in replacements})
        foreign = _foreign_stand_ins(model, stock) if model_type in bundle.model_types else []
        if foreign:
            where, found, stock_name, has_linear = foreign[0]
            what = (
                "it holds nn.Linear layers already, which quantizers see without this bundle"
                if has_linear
                else "it holds no class this bundle can swap"
            )
            warnings.warn(
                f"Bundle {bundle.name!r} swapped nothing in the {type(model).__name__} just loaded: another tool "
                f"replaced the modules it swaps before it could. {where} is {found}, not the stock {stock_name} "
                f"({len(foreign)} such module(s)); {what}. Disable {bundle.name!r}, or load without the "
                f"other tool's replacement to use the bundle's (it loads both checkpoint layouts, saves the stock "
                "one, and disable_bundle undoes it).",
                LayerswapWarning,
                stacklevel=4,
            )
            continue
        warnings.warn(
            f"Bundle {bundle.name!r} (for {', '.join(bundle.model_types)}) swapped nothing in the "
            f"{type(model).__name__} just loaded (model type {model_type!r}). Enable the bundle for this "
            "model's family (`layerswap list`), or disable this one.",
            LayerswapWarning,
            stacklevel=4,
        )


# Where a model holds the modules a bundle swaps, by the stock class name's ending: the attribute names the stock
# modeling code gives them (qwen2_moe's `mlp.experts`, `mlp.gate`, `self_attn`).
_PLACES = {
    "Experts": ("experts",),
    "Router": ("gate", "router"),
    "Attention": ("self_attn", "attn", "attention"),
}


def _foreign_stand_ins(model: nn.Module, stock: list[str]) -> list[tuple[str, str, str, bool]]:
    """(module path, description, stock class name, holds linear layers) for each module standing where a stock
    class of `stock`, absent from the model, would be, whose class is another tool's (neither transformers' nor
    layerswap's): Defuser's `LinearQwen2MoeSparseMoeBlock` holding an nn.ModuleList of per-expert MLPs, say."""
    modules = dict(model.named_modules())
    present = {type(m).__name__ for m in modules.values()}
    found = []
    for stock_name in stock:
        if stock_name in present:
            continue
        attributes = next((names for end, names in _PLACES.items() if stock_name.endswith(end)), ())
        for path, module in modules.items():
            if path.rpartition(".")[2] not in attributes or is_swapped(module):
                continue
            owner = _foreign_owner(modules, path)
            if owner is None:
                continue
            owner_path, owner_class = owner
            children = {type(m).__name__ for m in module.children()}
            holds = type(module).__name__ + (f" of {', '.join(sorted(children))}" if children else "")
            description = f"{owner_class.__module__}.{owner_class.__qualname__}"
            if owner_path != path:
                description += f" (its {path.rpartition('.')[2]}: {holds})"
            has_linear = any(isinstance(m, nn.Linear) or is_quantized_linear(m) for m in module.modules())
            found.append((path, description, stock_name, has_linear))
    return found


def _foreign_owner(modules: dict[str, nn.Module], path: str) -> tuple[str, type] | None:
    """The module at `path`, or the nearest module above it, whose class is not transformers', torch's or
    layerswap's; None if there is none (the module is transformers' own: a model of another family)."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        cls = type(modules[candidate])
        if not cls.__module__.startswith(("transformers.", "torch.", "layerswap.")):
            return candidate, cls
    return None
