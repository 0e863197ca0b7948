"""What layerswap wraps in transformers while at least one bundle is enabled, and how it is put back.

- `patch_output_recorders` rewrites `_can_record_outputs` on model classes in place, and nothing in transformers
  undoes it; the wrapper journals every dict and recorder before it is rewritten, so disabling restores them.
- `PreTrainedModel._finalize_model_loading` would give swapped-in modules whose weights the checkpoint lacks a
  random init; the wrapper raises MissingExpertWeightsError first (WeightConversionError when it was the quantizer
  that failed on weights the checkpoint has), warns when a bundle swapped nothing, and
  after a quantized load keeps quantized swapped-in layers saving as they are and trims the heap.
- `HfQuantizer.preprocess_model` refuses quantizers that cannot work with a bundle, and makes the quantizer of a
  model with swapped-in modules quantize one weight per call, handing the heap's freed transients back to the OS
  as it goes (`trim_heap`).
- `HfQuantizer.get_modules_to_not_convert` gets the bundles' keep-unquantized modules (routers, 1-wide gates).
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import modeling_utils, monkey_patching
from transformers.modeling_utils import PreTrainedModel
from transformers.quantizers.base import HfQuantizer
from transformers.utils.output_capturing import OutputRecorder

from ._errors import (
    IncompatibleQuantizerError,
    LayerswapWarning,
    MissingExpertWeightsError,
    WeightConversionError,
)

# (owner, attribute name, original value as found in owner.__dict__)
_installed: list[tuple[Any, str, Any]] = []
# id(dict) -> (the dict, its items before any rewrite, [(recorder, its target_class before)])
_recorder_journal: dict[int, tuple[dict, dict, list[tuple[OutputRecorder, Any]]]] = {}


def install() -> None:
    if _installed:
        return
    _wrap(modeling_utils, "apply_patches", _make_exception_safe_apply_patches)
    _wrap(modeling_utils, "patch_output_recorders", _make_journaling_patch_output_recorders)
    _wrap(PreTrainedModel, "_finalize_model_loading", _make_guarded_finalize)
    _wrap(HfQuantizer, "get_modules_to_not_convert", _make_skip_aware_modules_to_not_convert)
    _wrap(HfQuantizer, "preprocess_model", _make_checked_preprocess_model)


def uninstall() -> None:
    restore_output_recorders()
    while _installed:
        owner, attribute, original = _installed.pop()
        setattr(owner, attribute, original)


def installed_attributes() -> tuple[tuple[Any, str], ...]:
    return tuple((owner, attribute) for owner, attribute, _ in _installed)


def _wrap(owner: Any, attribute: str, make_wrapper: Any) -> None:
    original = owner.__dict__[attribute] if isinstance(owner, type) else getattr(owner, attribute)
    _installed.append((owner, attribute, original))
    setattr(owner, attribute, make_wrapper(original))


# --- class swapping ---------------------------------------------------------------------------------------


# Model construction swaps classes in transformers' module globals, which two threads building at once would
# interleave (one thread's restore un-patching the other's model). Construction is serialised; weights still
# load in parallel.
_BUILD_LOCK = threading.RLock()


def _make_exception_safe_apply_patches(original: Any) -> Any:
    """transformers' apply_patches restores the swapped classes only when the block ends normally: an exception
    while a model is built (a bad config, say) would leave replacement classes in transformers' modules for
    good. This wrapper restores them on every exit, and serialises construction across threads."""

    @contextmanager
    def apply_patches() -> Iterator[None]:
        with _BUILD_LOCK, _restoring_original_classes(original):
            yield

    return apply_patches


@contextmanager
def _restoring_original_classes(original: Any) -> Iterator[None]:
    names = set(monkey_patching.get_patch_mapping())
    bindings = [
        (module, name, vars(module)[name])
        for module in list(sys.modules.values())
        if getattr(module, "__name__", "").startswith("transformers") and not isinstance(module, type)
        for name in names & set(getattr(module, "__dict__", {}))
    ]
    context = _swap_classes() if _find_replacement_class is not None else original()
    context.__enter__()
    try:
        yield
    finally:
        try:
            context.__exit__(None, None, None)  # runs the swap's own restore, also after an error
        finally:
            for module, name, value in bindings:
                setattr(module, name, value)


_find_replacement_class = getattr(monkey_patching, "_find_replacement_class", None)


@contextmanager
def _swap_classes() -> Iterator[None]:
    """transformers' apply_patches, without its cost: it lists the names of every transformers module with `dir()`,
    which takes ~40 ms for each of its lazy modules (0.33 s of every model build, doubling a 325 MiB load). This
    swaps the classes bound in each imported transformers module's `__dict__`, matched by transformers' own
    `_find_replacement_class`, and gets nothing through the module: a lazy module's names not imported yet, and
    whatever an alias module's `__getattr__` serves, would be imported on access (transformers 5.17 aliases every
    image-processor module that way, and getting its `__all__` imported torchvision). The classes a model build
    uses are bound in its modeling module, which is imported by then."""
    mapping = monkey_patching.get_patch_mapping()
    swapped: list[tuple[Any, str, type]] = []
    if mapping:
        for module in list(sys.modules.values()):
            if not getattr(module, "__name__", "").startswith("transformers") or isinstance(module, type):
                continue
            for name, value in list(vars(module).items()):
                if not isinstance(value, type):
                    continue
                replacement = _find_replacement_class(name, mapping)
                if replacement is not None:
                    swapped.append((module, name, value))
                    setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, value in reversed(swapped):
            setattr(module, name, value)


# --- output recorders -------------------------------------------------------------------------------------


def _journal_recorders(model: nn.Module) -> None:
    for module in model.modules():
        recorders = getattr(type(module), "_can_record_outputs", None)
        if not isinstance(recorders, dict) or id(recorders) in _recorder_journal:
            continue
        targets = []
        for value in recorders.values():
            for recorder in value if isinstance(value, list) else [value]:
                if isinstance(recorder, OutputRecorder):
                    targets.append((recorder, recorder.target_class))
        _recorder_journal[id(recorders)] = (recorders, dict(recorders), targets)


def restore_output_recorders() -> None:
    while _recorder_journal:
        _, (recorders, items, targets) = _recorder_journal.popitem()
        recorders.clear()
        recorders.update(items)
        for recorder, target_class in targets:
            recorder.target_class = target_class


def _make_journaling_patch_output_recorders(original: Any) -> Any:
    """transformers calls patch_output_recorders right after building a model (from_config and from_pretrained):
    the one point where layerswap sees every freshly built model."""

    def patch_output_recorders(model: nn.Module) -> None:
        _journal_recorders(model)
        _remember_conversions(model)
        original(model)

    return patch_output_recorders


def _remember_conversions(model: nn.Module) -> None:
    """Give a swapped model the conversions in force when it was built, so save_pretrained writes the stock
    layout even after the bundle is disabled. (from_pretrained later replaces this with the transforms its
    checkpoint used; a from_config model would otherwise look the registry up at save time.)"""
    if not swapped_modules(model) or getattr(model, "_weight_conversions", None) is not None:
        return
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    conversions = get_model_conversion_mapping(model, add_legacy=False)
    # As transformers' own revert does for models not built by from_pretrained.
    model._weight_conversions = [c for c in conversions if not isinstance(c, PrefixChange)]


# --- load guard -------------------------------------------------------------------------------------------


def _make_guarded_finalize(original: staticmethod) -> staticmethod:
    finalize = original.__func__

    def _finalize_model_loading(model: Any, load_config: Any, loading_info: Any) -> Any:
        swapped = swapped_modules(model)  # one walk of the module tree for every check below
        _raise_on_missing_swapped_weights(swapped, load_config, loading_info)
        result = finalize(model, load_config, loading_info)
        _warn_on_bundles_that_swapped_nothing(model, swapped)
        if getattr(load_config, "hf_quantizer", None) is not None and swapped:
            _save_quantized_layers_as_loaded(model)
            trim_heap()
        return result

    return staticmethod(_finalize_model_loading)


def _save_quantized_layers_as_loaded(model: nn.Module) -> None:
    """Quantized weights cannot be re-laid-out on save: bitsandbytes' packed 4-bit weights come with per-layer quant
    states, int8 ones with per-row scales. They can be neither stacked (experts into granitemoe's fused
    `[E, 2I, H]`) nor split (a fused `qkv_proj` into q/k/v). So a quantized model saves the layers layerswap swapped
    in as they are (experts one by one, one `qkv_proj`), and the same bundle loads them back. Stock transformers
    loads quantized experts in no layout at all."""
    from .adapters.attention import FusedQKVAttention
    from .adapters.experts import LinearExperts
    from .conversions.experts import FusedToLinearExperts
    from .conversions.qkv import FusedQKVConverter
    from .report import is_quantized_linear

    kept_as_loaded: set[type] = set()
    for module in model.modules():
        if isinstance(module, LinearExperts) and any(is_quantized_linear(m) for m in module.modules()):
            kept_as_loaded.add(FusedToLinearExperts)
        elif isinstance(module, FusedQKVAttention) and is_quantized_linear(module.qkv_proj):
            kept_as_loaded.add(FusedQKVConverter)
    conversions = getattr(model, "_weight_conversions", None)
    if kept_as_loaded and conversions:
        model._weight_conversions = [c for c in conversions if type(c) not in kept_as_loaded]


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc only; elsewhere a no-op).

    Quantizing every expert on CPU allocates and frees a transient per weight, and glibc's growing mmap threshold
    keeps those freed blocks on the heap: a 325 MiB qwen2_moe nf4 load measured, in about one run of two, a peak of
    1.2-1.6 GiB and 1.2 GiB resident after loading, with 94 MiB of live tensors. Trimming while quantizing
    (_quantize_one_weight_per_call) and at the end of the load keeps both at what the weights need."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(AttributeError, OSError):  # not glibc
        ctypes.CDLL(None).malloc_trim(0)


# CPU bytes quantized between two heap trims while loading. On a 325 MiB qwen2_moe nf4 load, trimming every 8 MiB kept
# the peak at 458-487 MiB over 10 loads (without: 460-1620 MiB), for about 5% more load time; every weight, 27% more.
TRIM_EVERY_BYTES = 8 << 20


def _quantize_one_weight_per_call(quantizer: HfQuantizer) -> None:
    """Make this quantizer's quantize ops take one weight per call, and trim the heap every TRIM_EVERY_BYTES of
    CPU weights they quantize (see trim_heap).

    A fused checkpoint's split hands the quantize op every expert of a layer in one dict (64 weights), where stock
    conversions hand it one tensor. torchao's and quanto's ops quantize only the tensor named by
    `full_layer_name` (quanto's reads it as a list), so the other experts would come out missing, and bitsandbytes' op would hold all its
    transients until the end of the call. Patches this one quantizer object, which lives only as long as the model
    it loads; nothing global changes."""
    get_quantize_ops = quantizer.get_quantize_ops
    pending = [0]

    def count(value: Any) -> None:
        # Only CPU weights leave transients on the C heap; quantizing on a GPU needs no trim.
        for tensor in value if isinstance(value, list) else [value]:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                pending[0] += tensor.nbytes
        if pending[0] >= TRIM_EVERY_BYTES:
            pending[0] = 0
            trim_heap()

    def one_weight_per_call(op: Any) -> Any:
        convert = op.convert

        def convert_each(input_dict: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
            if len(input_dict) == 1:
                result = convert(input_dict, *args, **kwargs)
                count(next(iter(input_dict.values())))
                return result
            result = {}
            for key, value in input_dict.items():
                # As a renamed weight reaches it: a list of one tensor (quanto's op reads `value[0]`).
                single = {key: value if isinstance(value, list) else [value]}
                result.update(convert(single, *args, **{**kwargs, "full_layer_name": key}))
                count(value)
            return result

        op.convert = convert_each
        return op

    quantizer.get_quantize_ops = lambda: one_weight_per_call(get_quantize_ops())


def swapped_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if hasattr(type(m), "_layerswap_original")]


def _raise_on_missing_swapped_weights(
    swapped: list[tuple[str, nn.Module]], load_config: Any, loading_info: Any
) -> None:
    prefixes = [name + "." for name, module in swapped if getattr(module, "_layerswap_strict", False)]
    if not prefixes:
        return
    missing = sorted(k for k in loading_info.missing_keys if any(k.startswith(p) for p in prefixes))
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
    model's type swapped nothing (its classes are not the ones this model uses)."""
    from ._registry import enabled_records

    swapped_classes = {type(m) for _, m in swapped}
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    records = [(bundle, replacements) for bundle, _, replacements in enabled_records() if replacements]
    idle = [bundle for bundle, replacements in records if not swapped_classes & replacements]
    if not records or not idle:
        return
    nothing_swapped = len(idle) == len(records)
    for bundle in idle:
        if nothing_swapped or model_type in bundle.model_types:
            warnings.warn(
                f"Bundle {bundle.name!r} (for {', '.join(bundle.model_types)}) swapped nothing in the "
                f"{type(model).__name__} just loaded (model type {model_type!r}). Enable the bundle for this "
                "model's family (`layerswap list`), or disable this one.",
                LayerswapWarning,
                stacklevel=4,
            )


# --- quantizer hints --------------------------------------------------------------------------------------


def _make_skip_aware_modules_to_not_convert(original: staticmethod) -> staticmethod:
    function = original.__func__

    def get_modules_to_not_convert(model: Any, *args: Any, **kwargs: Any) -> list[str]:
        return sorted(set(function(model, *args, **kwargs)) | set(keep_unquantized_modules(model)))

    return staticmethod(get_modules_to_not_convert)


def _make_checked_preprocess_model(original: Any) -> Any:
    def preprocess_model(self: HfQuantizer, model: Any, *args: Any, **kwargs: Any) -> Any:
        swapped = swapped_modules(model)
        _refuse_incompatible_quantizer(self, swapped)
        if swapped:
            _quantize_one_weight_per_call(self)
        return original(self, model, *args, **kwargs)

    return preprocess_model


def keep_unquantized_modules(model: nn.Module) -> list[str]:
    """Full names of the modules in `model` that enabled bundles keep out of quantization."""
    from ._registry import enabled_records

    model_types = {getattr(getattr(m, "config", None), "model_type", None) for m in model.modules()}
    suffixes: set[str] = set()
    for bundle, options, _ in enabled_records():
        if model_types.isdisjoint(bundle.model_types):
            continue
        chosen = options.keep_unquantized if options.keep_unquantized is not None else bundle.keep_unquantized
        suffixes.update(chosen)
    if not suffixes:
        return []
    return [
        name
        for name, _ in model.named_modules()
        if name and any(name == s or name.endswith("." + s) for s in suffixes)
    ]


def _refuse_incompatible_quantizer(quantizer: HfQuantizer, swapped: list[tuple[str, nn.Module]]) -> None:
    if type(quantizer).__name__ != "FineGrainedFP8HfQuantizer":
        return
    experts = [name for name, m in swapped if name.endswith(".experts") and isinstance(m, nn.ModuleList)]
    if experts:
        raise IncompatibleQuantizerError(
            "transformers' finegrained_fp8 quantizer replaces every module named '*.experts' with its own fused "
            f"3D FP8 experts, which would swallow layerswap's per-expert nn.Linear layers (e.g. {experts[0]}). "
            "finegrained_fp8 already quantizes the stock fused experts: disable the '-quant' bundle for this load "
            "(layerswap.disable_bundle(...)), or use a quantizer that targets nn.Linear (bitsandbytes, torchao, quanto)."
        )
