"""Checkpoint conversions: the lists bundles register per model type, and the per-model lists that keep a model
the bundles did not swap loading and saving the stock way.

transformers keeps one conversion list per model type (`register_checkpoint_conversion_mapping`). `sync` registers,
for a model type, its stock list as edited by every enabled bundle, in enable order, and with no bundle left puts
back the original entry (or its absence) exactly, through a Journal. `get_model_conversion_mapping` is wrapped so
that a model some of those bundles did not swap gets the list that fits it (`conversion_overrides`).
"""

from __future__ import annotations

import copy
import re
import threading
from typing import Any

from torch import nn
from transformers import conversion_mapping
from transformers.core_model_loading import PrefixChange, WeightRenaming, WeightTransform, rename_source_key
from transformers.modeling_utils import PreTrainedModel

from .active import enabled_records, swapped_modules
from .journal import Journal

# model type -> (the journal of its registry entries, its stock list or None when it had none).
_edited: dict[str, tuple[Journal, list | None]] = {}
_lock = threading.RLock()


def _cache() -> dict[str, Any]:
    conversion_mapping.get_checkpoint_conversion_mapping("llama")  # builds the cache on first use
    return conversion_mapping._checkpoint_conversion_mapping_cache


def sync(model_type: str) -> None:
    """Register `model_type`'s stock conversions as edited by the enabled bundles (call with the registry's lock
    held, after every enable and disable of a bundle with conversions for it)."""
    with _lock:
        _sync(model_type)


def _sync(model_type: str) -> None:
    edits = [
        (record.bundle.conversions[model_type], record.options)
        for record in enabled_records()
        if model_type in record.bundle.conversions
    ]
    if model_type not in _edited:
        if not edits:
            return
        cache = _cache()
        journal = Journal()
        journal.remember_item(cache, model_type)
        journal.add_to_set(conversion_mapping.USER_REGISTERED_MAPPINGS, model_type)
        _edited[model_type] = (journal, copy.deepcopy(cache[model_type]) if model_type in cache else None)
    journal, stock = _edited[model_type]
    if not edits:
        journal.undo()
        del _edited[model_type]
        return
    conversion_mapping.register_checkpoint_conversion_mapping(
        model_type, _edited_list(stock, edits), overwrite=True
    )


def _edited_list(stock: list | None, edits: list[tuple[Any, Any]]) -> list:
    mapping = copy.deepcopy(stock) if stock is not None else []
    for edit, options in edits:
        mapping = edit(mapping, options)
    return mapping


def has_own_conversions(class_name: str) -> bool:
    """Whether transformers registers checkpoint conversions under this model class's name."""
    return class_name in _cache()


def stock_conversions(model_type: str) -> list | None:
    """A copy of `model_type`'s conversion list as transformers had it before any bundle edited it."""
    with _lock:
        if model_type in _edited:
            stock = _edited[model_type][1]
            return copy.deepcopy(stock) if stock is not None else None
    return conversion_mapping.get_checkpoint_conversion_mapping(model_type)


def conversion_overrides(model: nn.Module) -> dict[str, list | None]:
    """The conversion lists that fit `model`, for the model types in it whose registered lists enabled bundles
    edited but some of those bundles swapped nothing in `model` (one built before they were enabled, or with
    `Model(config)`): stock, as edited by only the bundles that did swap something. Empty when the registered
    lists fit. A bundle with no patches (conversions only) always applies."""
    records = [record for record in enabled_records() if record.bundle.conversions]
    if not records:
        return {}
    with _lock:
        return _overrides(model, records)


def _overrides(model: nn.Module, records: list) -> dict[str, list | None]:
    modules = list(model.modules())
    models = [m for m in modules if isinstance(m, PreTrainedModel)]
    # transformers looks a sub-model's conversions up by its class name first, then by its model type.
    model_types = {m.config.model_type for m in models} | {type(m).__name__ for m in models}
    classes = {type(m) for m in modules}
    overrides: dict[str, list | None] = {}
    for model_type in sorted(model_types & set(_edited)):
        editing = [record for record in records if model_type in record.bundle.conversions]
        applying = [r for r in editing if not r.replacements or not classes.isdisjoint(r.replacements)]
        if len(applying) == len(editing):
            continue
        stock = _edited[model_type][1]
        if not applying and stock is None:
            overrides[model_type] = None
            continue
        overrides[model_type] = _edited_list(
            stock, [(r.bundle.conversions[model_type], r.options) for r in applying]
        )
    return overrides


def source_patterns(transform: WeightTransform) -> list[str]:
    """The checkpoint-side key patterns of `transform`, as written (before transformers compiles them)."""
    return list(transform._original_source_patterns)


def target_patterns(transform: WeightTransform) -> list[str]:
    """The model-side key patterns of `transform`, as written."""
    return list(transform._original_target_patterns)


# --- per-model conversions -------------------------------------------------------------------------------

# The conversion lists that fit the model whose get_model_conversion_mapping is running in this thread.
_conversion_overrides = threading.local()


def make_per_model_conversions(original: Any) -> Any:
    """A bundle's conversions are registered for its model type, so a model of that type the bundle did not swap
    (built before it was enabled, or with `Model(config)`) would load and save by them: `save_pretrained` wrote
    the fused layout for a stock model under `-quant`. This looks up, for each model, the lists of the bundles
    that swapped it, stock for the others."""

    def get_model_conversion_mapping(model: Any, *args: Any, **kwargs: Any) -> Any:
        overrides = conversion_overrides(model)
        if not overrides:
            return _bound(model, _keeping_stock_names(model, original(model, *args, **kwargs)))
        previous = getattr(_conversion_overrides, "lists", None)
        _conversion_overrides.lists = {**(previous or {}), **overrides}
        try:
            return _bound(model, _keeping_stock_names(model, original(model, *args, **kwargs)))
        finally:
            _conversion_overrides.lists = previous

    return get_model_conversion_mapping


def _bound(model: Any, conversions: Any) -> Any:
    """`conversions`, each that asks (`_layerswap_bind_model`) told the model it loads into: one that targets a
    swapped module's weights may need the model as sharded, which happens after this list is made."""
    if isinstance(conversions, list):
        for conversion in conversions:
            bind = getattr(conversion, "_layerswap_bind_model", None)
            if bind is not None:
                bind(model)
    return conversions


class _KeepStockName(WeightRenaming):
    """Undoes the renamings' change to a key that is already the stock model's own name; load-only."""

    def reverse_transform(self) -> WeightTransform:
        return WeightRenaming(source_patterns=r"(?!)", target_patterns=r"(?!)")


def _keeping_stock_names(model: nn.Module, conversions: Any) -> Any:
    """transformers renames a checkpoint key and, when the model lacks the renamed key but has the original one,
    loads it under its original name: that is how a v5 checkpoint saved with `save_original_format=False`
    loads in families whose renamings expect the original hub layout (mistral_large4 turns `.experts.` into
    `.mlp.experts.`, deepseek_ocr2 prefixes `model.language_model.` again). A swapped module no longer has the
    stock parameter names, so that fallback cannot happen and its weights would load nowhere. This appends a
    renaming that maps each such renamed stock name back (one per name with the layer index as a wildcard), so
    the swap's own conversions see the stock name, as they do in every other family."""
    if not isinstance(conversions, list):
        return conversions
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    if not renamings:
        return conversions
    undo: dict[str, str] = {}
    for path, module in swapped_modules(model):
        for name in getattr(module, "_layerswap_stock_parameter_names", ()):
            key = f"{path}.{name}"
            renamed, _ = rename_source_key(key, renamings, [])
            if renamed != key:
                source = "^" + re.sub(r"\\.(\d+)\\.", r"\\.(\\d+)\\.", re.escape(renamed), count=1) + "$"
                undo.setdefault(source, re.sub(r"\.\d+\.", r".\\1.", key, count=1))
    extra = [
        _KeepStockName(source_patterns=source, target_patterns=target) for source, target in undo.items()
    ]
    return conversions + extra if extra else conversions


def make_overridable_checkpoint_conversions(original: Any) -> Any:
    def get_checkpoint_conversion_mapping(model_type: str) -> Any:
        overrides = getattr(_conversion_overrides, "lists", None)
        if overrides and model_type in overrides:
            return copy.deepcopy(overrides[model_type])
        return original(model_type)

    return get_checkpoint_conversion_mapping


def remember_conversions(model: nn.Module) -> None:
    """Give a swapped model the conversions in force when it was built, so save_pretrained writes the stock
    layout even after the bundle is disabled. (from_pretrained later replaces this with the transforms its
    checkpoint used; a from_config model would otherwise look the registry up at save time.)"""
    if not swapped_modules(model) or getattr(model, "_weight_conversions", None) is not None:
        return
    conversions = conversion_mapping.get_model_conversion_mapping(model, add_legacy=False)
    # As transformers' own revert does for models not built by from_pretrained.
    model._weight_conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
