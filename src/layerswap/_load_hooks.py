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
import copy
import ctypes
import re
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import conversion_mapping, modeling_utils, monkey_patching
from transformers.modeling_utils import PreTrainedModel
from transformers.quantizers.base import HfQuantizer
from transformers.utils.output_capturing import OutputRecorder

from ._errors import (
    CheckpointShapeError,
    IncompatibleQuantizerError,
    LayerswapWarning,
    MissingExpertWeightsError,
    WeightConversionError,
)
from ._plans import rewrite_tp_plans

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
    _wrap(conversion_mapping, "get_checkpoint_conversion_mapping", _make_overridable_checkpoint_conversions)
    _wrap(PreTrainedModel, "post_init", _make_checked_post_init)
    if "set_experts_implementation" in vars(PreTrainedModel):
        _wrap(PreTrainedModel, "set_experts_implementation", _make_checked_set_experts_implementation)
    model_conversions = conversion_mapping.get_model_conversion_mapping
    for module in _modules_binding(model_conversions):
        _wrap(module, "get_model_conversion_mapping", _make_per_model_conversions)


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


# --- per-model conversions -------------------------------------------------------------------------------

# The conversion lists that fit the model whose get_model_conversion_mapping is running in this thread.
_conversion_overrides = threading.local()


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


def _make_per_model_conversions(original: Any) -> Any:
    """A bundle's conversions are registered for its model type, so a model of that type the bundle did not swap
    (built before it was enabled, or with `Model(config)`) would load and save by them: `save_pretrained` wrote
    the fused layout for a stock model under `-quant`. This looks up, for each model, the lists of the bundles
    that swapped it, stock for the others."""

    def get_model_conversion_mapping(model: Any, *args: Any, **kwargs: Any) -> Any:
        from ._registry import conversion_overrides

        overrides = conversion_overrides(model)
        if not overrides:
            return original(model, *args, **kwargs)
        previous = getattr(_conversion_overrides, "lists", None)
        _conversion_overrides.lists = {**(previous or {}), **overrides}
        try:
            return original(model, *args, **kwargs)
        finally:
            _conversion_overrides.lists = previous

    return get_model_conversion_mapping


def _make_overridable_checkpoint_conversions(original: Any) -> Any:
    def get_checkpoint_conversion_mapping(model_type: str) -> Any:
        overrides = getattr(_conversion_overrides, "lists", None)
        if overrides and model_type in overrides:
            return copy.deepcopy(overrides[model_type])
        return original(model_type)

    return get_checkpoint_conversion_mapping


# --- experts implementation ------------------------------------------------------------------------------

# Set in a swapped experts module's __dict__ once set_experts_implementation chose its implementation.
EXPERTS_IMPLEMENTATION_CHOSEN = "_layerswap_experts_implementation_chosen"


def _make_checked_set_experts_implementation(original: Any) -> Any:
    """`set_experts_implementation` only sets the config, which swapped experts computing their own way would
    ignore. Each swapped experts module checks the implementation first (the '-quant' experts refuse those they
    cannot run, before anything changes) and is marked as having had one chosen (the '-fast' experts then run it,
    even the one the config already named)."""

    def set_experts_implementation(self: Any, experts_implementation: str | dict) -> Any:
        experts = [
            (module, _implementation_for(self, module, experts_implementation))
            for _, module in swapped_modules(self)
            if hasattr(module, "_layerswap_check_experts_implementation")
        ]
        for module, requested in experts:
            if requested is not None:
                module._layerswap_check_experts_implementation(requested)
        result = original(self, experts_implementation)
        for module, requested in experts:
            if requested is not None:
                module.__dict__[EXPERTS_IMPLEMENTATION_CHOSEN] = True
        return result

    return set_experts_implementation


def _implementation_for(model: Any, module: nn.Module, requested: str | dict) -> str | None:
    """The implementation a `set_experts_implementation(requested)` call gives `module` (None: it keeps its own),
    by transformers' rule: a string goes to every submodel; a dict's "" key to the model's own config, its other
    keys to the sub-config of that name."""
    if not isinstance(requested, dict):
        return requested
    config = getattr(module, "config", None)
    if config is model.config:
        return requested.get("")
    for key in getattr(model.config, "sub_configs", {}) or {}:
        if getattr(model.config, key, None) is config:
            return requested.get(key)
    return None


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
            _building.depth = getattr(_building, "depth", 0) + 1
            try:
                yield
            finally:
                _building.depth -= 1

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


# --- manual construction (`Model(config)`) ------------------------------------------------------------------

# Builds inside transformers' apply_patches (from_pretrained, from_config) in this thread.
_building = threading.local()
# (module name, class name) -> [module, stock class, replacement, open blocks]: classes swapped in transformers'
# modules for `use_bundle` / `apply_bundles` blocks, so that `Model(config)` inside them is swapped too.
_construction_swaps: dict[tuple[str, str], list[Any]] = {}


def swap_for_construction(read_replacements: Any) -> list[tuple[str, str]]:
    """Bind each replacement (class name -> class, from `read_replacements()`) in place of its stock class in the
    imported transformers modules, until `unswap_for_construction` of the returned token; blocks that swap the same
    class are counted. Holds the build lock, so no model build sees half a swap."""
    entered = []
    with _BUILD_LOCK:
        for class_name, replacement in read_replacements().items():
            stock = replacement._layerswap_original
            for module_name, module in list(sys.modules.items()):
                if not module_name.startswith("transformers") or module is None or isinstance(module, type):
                    continue
                key = (module_name, class_name)
                entry = _construction_swaps.get(key)
                if entry is not None and entry[2] is replacement:
                    entry[3] += 1
                elif getattr(module, "__dict__", {}).get(class_name) is stock:
                    _construction_swaps[key] = [module, stock, replacement, 1]
                    setattr(module, class_name, replacement)
                else:
                    continue
                entered.append(key)
    return entered


def unswap_for_construction(entered: list[tuple[str, str]]) -> None:
    with _BUILD_LOCK:
        for key in entered:
            entry = _construction_swaps.get(key)
            if entry is None:
                continue
            entry[3] -= 1
            if entry[3] == 0:
                del _construction_swaps[key]
                module, stock, replacement, _ = entry
                if vars(module).get(key[1]) is replacement:
                    setattr(module, key[1], stock)


def _make_checked_post_init(original: Any) -> Any:
    """Every PreTrainedModel's constructor ends in post_init. A model built by its constructor outside
    transformers' apply_patches gets, when swapped (inside `use_bundle` / `apply_bundles`), the conversions in
    force (as from_config's do, so it saves the stock layout after the bundle is disabled); unswapped, a warning
    when an enabled bundle serves its family."""

    def post_init(self: Any) -> None:
        original(self)
        if not getattr(_building, "depth", 0):
            if swapped_modules(self):
                _remember_conversions(self)
                rewrite_tp_plans(self)
            else:
                _warn_on_unswapped_construction(self)

    return post_init


# Models warned about, so that the outer model of a nested pair (ForCausalLM around Model) does not warn again.
_warned_unswapped: weakref.WeakSet = weakref.WeakSet()


def _warn_on_unswapped_construction(model: nn.Module) -> None:
    from ._registry import enabled_records

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    records = [
        (bundle, replacements)
        for bundle, _, replacements in enabled_records()
        if replacements and model_type in bundle.model_types
    ]
    if not records:
        return
    modules = list(model.modules())
    if any(m in _warned_unswapped for m in modules):
        _warned_unswapped.add(model)
        return
    names = {type(m).__name__ for m in modules}
    for bundle, replacements in records:
        stock = sorted({r._layerswap_original.__name__ for r in replacements} & names)
        if stock:
            _warned_unswapped.add(model)
            warnings.warn(
                f"{type(model).__name__} was built by its constructor with the stock {', '.join(stock)} although "
                f"bundle {bundle.name!r} is enabled: only from_pretrained and from_config swap classes by "
                "themselves. Build it inside `with layerswap.apply_bundles():` (or `with "
                f"layerswap.use_bundle({bundle.name!r}):`) to swap it; as built, it is a stock model and saves the "
                "stock layout.",
                LayerswapWarning,
                stacklevel=4,
            )
            return


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
        before = _recorders_of(model)
        original(model)
        _keep_stock_classes_recorded(before)
        rewrite_tp_plans(model)

    return patch_output_recorders


def _recorders_of(model: nn.Module) -> list[tuple[dict, dict, dict[int, Any]]]:
    """(dict, its items, {id(recorder): its target_class}) for each `_can_record_outputs` dict of `model`'s
    classes, as they are now."""
    found: dict[int, tuple[dict, dict, dict[int, Any]]] = {}
    for module in model.modules():
        recorders = getattr(type(module), "_can_record_outputs", None)
        if isinstance(recorders, dict) and id(recorders) not in found:
            targets = {
                id(recorder): recorder.target_class
                for value in recorders.values()
                for recorder in (value if isinstance(value, list) else [value])
                if isinstance(recorder, OutputRecorder)
            }
            found[id(recorders)] = (recorders, dict(recorders), targets)
    return list(found.values())


def _keep_stock_classes_recorded(before: list[tuple[dict, dict, dict[int, Any]]]) -> None:
    """transformers' patch_output_recorders points each recorder of a patched class at the replacement, in the
    `_can_record_outputs` dict every model of that class shares: stock-built models of the class (one built before
    the bundle was enabled, or with `Model(config)`) then recorded no attentions or router logits. A layerswap
    replacement subclasses the class it replaces, so the stock recorder already records it (also after the bundle
    is disabled): put that back. A replacement that does not subclass it (LinearExperts, which no family records)
    is recorded beside a plain-class recorder."""
    for recorders, items, targets in before:
        for key, value in list(recorders.items()):
            old = items.get(key)
            if value is old:
                continue  # an OutputRecorder (or a list of them) patched in place, or nothing changed
            olds = old if isinstance(old, list) else [old]
            news = value if isinstance(value, list) else [value]
            if len(olds) != len(news):
                continue
            kept = [_stock_side(o, n) for o, n in zip(olds, news, strict=True)]
            flat = [r for pair in kept for r in pair]
            recorders[key] = flat if isinstance(old, list) or len(flat) > 1 else flat[0]
        for value in recorders.values():
            for recorder in value if isinstance(value, list) else [value]:
                if isinstance(recorder, OutputRecorder) and id(recorder) in targets:
                    _restore_stock_target(recorder, targets[id(recorder)])


def _is_layerswap_replacement(new: Any, old: Any) -> bool:
    return isinstance(new, type) and hasattr(new, "_layerswap_original") and new is not old


def _stock_side(old: Any, new: Any) -> list[Any]:
    """What a plain class (or class name) recorder `old`, rewritten to `new`, should record."""
    if isinstance(old, OutputRecorder) or not _is_layerswap_replacement(new, old):
        return [new]
    stock = new._layerswap_original
    if isinstance(old, type) and issubclass(new, old):
        return [old]
    if isinstance(old, str) and issubclass(new, stock) and stock.__name__ == old:
        return [old]
    return [old, new]


def _restore_stock_target(recorder: OutputRecorder, target: Any) -> None:
    new = recorder.target_class
    if _is_layerswap_replacement(new, target) and (target is None or issubclass(new, target)):
        recorder.target_class = target


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
        _raise_on_wrong_shaped_swapped_weights(swapped, load_config, loading_info)
        if not _loads_no_weights_at_all(model, load_config, loading_info):
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


def _raise_on_wrong_shaped_swapped_weights(
    swapped: list[tuple[str, nn.Module]], load_config: Any, loading_info: Any
) -> None:
    """A checkpoint tensor of a swapped module with another shape is named, with both shapes, in the exception
    (transformers names it only in its logged load report): one transformers recorded as mismatched, or one that a
    '-fast' bundle's checked per-expert merge refused (stock would report the stacked weight as missing)."""
    from .conversions.shape_checks import ShapeCheckedMergeModulelist

    prefixes = tuple(name + "." for name, _ in swapped)
    if not prefixes:
        return
    source = getattr(load_config, "pretrained_model_name_or_path", None) or "the checkpoint"
    errors: dict[str, str] = getattr(loading_info, "conversion_errors", None) or {}
    for key, text in sorted(errors.items()):
        op_name, error = _summarize_conversion_error(text)
        if key.startswith(prefixes) and op_name == ShapeCheckedMergeModulelist.__name__:
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
