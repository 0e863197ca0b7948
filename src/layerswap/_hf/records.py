"""The bundles a checkpoint needs, recorded in its config.json, and the loads that lack them refused.

A model layerswap swapped usually saves the stock layout, which stock transformers loads. A quantized one does not:
its quantized experts (or fused `qkv_proj`) save as loaded, one by one, a layout stock transformers has no
conversion for. Loading such a checkpoint without the bundle leaves the experts randomly initialised with only a
load-report table (torchao), or loads bitsandbytes' int8 bytes as weights: silent corruption. So:

- `save_pretrained` writes `"layerswap": {"bundles": [...], "options": {...}, "version": ...}` into config.json when
  the saved layout is one only the bundles load (and only then: a stock-layout save's config.json stays exactly
  stock's, so nothing claims that a plain checkpoint needs layerswap);
- `_finalize_model_loading` raises CheckpointNeedsBundleError when a checkpoint with such a record was loaded
  without the bundles it names and the load shows it (weights missing, unused, or of another shape), before
  transformers initialises the missing weights.

Both wrappers are installed when layerswap is imported (`watch`), not only while a bundle is enabled: the load that
needs the check is the one without the bundle, and a model loaded inside `use_bundle` is often saved after it.
They change nothing for a model without swapped modules or a checkpoint without a record.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from collections.abc import Iterable, Mapping
from importlib import metadata
from typing import Any

from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_utils import PreTrainedModel

from ..bundle import BundleOptions
from ..errors import BundleError, CheckpointNeedsBundleError, LayerswapWarning
from ..quantized import is_quantized_linear
from .active import enabled_records, swapped_modules
from .journal import Journal

RECORD_KEY = "layerswap"
# The bundles (name -> non-default options) that swapped a model, set on it when it is built (patching.post_init).
_BUILT_UNDER = "_layerswap_built_under"
_journal = Journal()
# The swapped model each config belongs to, by the config's id (configs compare by value, so are unhashable):
# some tools write config.json with the config's own save_pretrained and their weights themselves (auto-round
# 0.16's "immediate saving"), so the model's save_pretrained, which writes the record, never runs.
_model_of_config: dict[int, tuple[weakref.ref, weakref.ref]] = {}


# --- the record ----------------------------------------------------------------------------------------------


def parse_record(value: Any, source: str = "the checkpoint") -> dict[str, dict[str, Any]]:
    """{bundle name: options} from a config's `layerswap` entry; BundleError naming `source` if it is malformed."""
    bundles = value.get("bundles") if isinstance(value, Mapping) else None
    options = value.get("options", {}) if isinstance(value, Mapping) else None
    if (
        not isinstance(bundles, list)
        or not bundles
        or not all(isinstance(name, str) and name for name in bundles)
        or not isinstance(options, Mapping)
        or not all(isinstance(o, Mapping) for o in options.values())
    ):
        raise BundleError(
            f"{source}'s config.json has a {RECORD_KEY!r} entry layerswap did not write: expected "
            f'{{"bundles": ["<family>-<purpose>", ...], "options": {{...}}, "version": "..."}}, found {value!r}. '
            f"Fix or remove that entry."
        )
    return {name: dict(options.get(name, {})) for name in bundles}


def options_record(options: BundleOptions) -> dict[str, Any]:
    """The options that differ from the defaults, JSON-ready."""
    record = {}
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if value != field.default:
            record[field.name] = list(value) if isinstance(value, tuple) else value
    return record


def remember_bundles(model: nn.Module, swapped: list[tuple[str, nn.Module]]) -> None:
    """Called when a swapped model is built: the enabled bundles whose classes are in it, with their options."""
    classes = {type(m) for _, m in swapped}
    built_under = {
        record.bundle.name: options_record(record.options)
        for record in enabled_records()
        if classes & record.replacements
    }
    if built_under:
        vars(model)[_BUILT_UNDER] = built_under
    config = getattr(model, "config", None)
    if isinstance(
        config, PretrainedConfig
    ):  # the outer model (ForCausalLM around Model) is built last: it wins
        for key in [k for k, (c, m) in _model_of_config.items() if c() is None or m() is None]:
            del _model_of_config[key]
        _model_of_config[id(config)] = (weakref.ref(config), weakref.ref(model))


def _model_of(config: PretrainedConfig) -> nn.Module | None:
    config_ref, model_ref = _model_of_config.get(id(config), (None, None))
    if config_ref is None or config_ref() is not config:
        return None
    return model_ref()


def _version() -> str | None:
    try:
        return metadata.version("layerswap")
    except metadata.PackageNotFoundError:
        return None


def needed_record(model: nn.Module, swapped: list[tuple[str, nn.Module]]) -> dict[str, Any] | None:
    """The record a save of `model` needs, or None when it saves a layout stock transformers loads. Swapped modules
    holding quantized layers save them as they are (loading._save_quantized_layers_as_loaded). Every other swapped
    save is stock transformers' to load: the conversions save the stock layout, and a `save_original_format=False`
    save (the swapped modules' own names) loads in stock too (measured: qwen2_moe and mixtral, zero missing keys)."""
    if not any(is_quantized_linear(m) for _, module in swapped for m in module.modules()):
        return None
    built_under = vars(model).get(_BUILT_UNDER)
    if not built_under:  # built before layerswap remembered it: the bundles enabled now that swapped it
        remember_bundles(model, swapped)
        built_under = vars(model).get(_BUILT_UNDER)
    if not built_under:  # loaded from a recorded checkpoint some other way: keep what it said
        try:
            built_under = parse_record(getattr(getattr(model, "config", None), RECORD_KEY, None))
        except BundleError:
            return None
    return {
        "bundles": list(built_under),
        "options": {name: options for name, options in built_under.items() if options},
        "version": _version(),
        "note": "quantized layers saved as loaded, which stock transformers does not load: "
        "load with layerswap.from_pretrained",
    }


# --- the wrappers ----------------------------------------------------------------------------------------------


def make_recording_save_pretrained(original: Any) -> Any:
    @functools.wraps(original)
    def save_pretrained(self: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        config = getattr(self, "config", None)
        if config is None:
            return original(self, save_directory, *args, **kwargs)
        swapped = swapped_modules(self)
        if (
            not swapped
        ):  # a model layerswap did not swap saves as transformers saves it, whatever its config says
            return original(self, save_directory, *args, **kwargs)
        record = needed_record(self, swapped)
        had, before = RECORD_KEY in vars(config), vars(config).get(RECORD_KEY)
        if record is not None:
            setattr(config, RECORD_KEY, record)
        elif had:
            delattr(config, RECORD_KEY)  # loaded from a recorded checkpoint, now saving the stock layout
        try:
            return original(self, save_directory, *args, **kwargs)
        finally:
            if had:
                setattr(config, RECORD_KEY, before)
            elif RECORD_KEY in vars(config):
                delattr(config, RECORD_KEY)

    return save_pretrained


def make_recording_config_save_pretrained(original: Any) -> Any:
    """A config saved on its own (not through its model's save_pretrained, which sets the record first) records
    the bundles its swapped model needs, as the model's save would."""

    @functools.wraps(original)
    def save_pretrained(self: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        model = _model_of(self) if RECORD_KEY not in vars(self) else None
        swapped = swapped_modules(model) if model is not None else []
        record = needed_record(model, swapped) if swapped else None
        if record is None:
            return original(self, save_directory, *args, **kwargs)
        setattr(self, RECORD_KEY, record)
        try:
            return original(self, save_directory, *args, **kwargs)
        finally:
            delattr(self, RECORD_KEY)

    return save_pretrained


def make_record_checking_finalize(original: staticmethod) -> staticmethod:
    finalize = original.__func__

    @functools.wraps(finalize)
    def _finalize_model_loading(model: Any, load_config: Any, loading_info: Any) -> Any:
        check_recorded_bundles(model, load_config, loading_info)
        return finalize(model, load_config, loading_info)

    return staticmethod(_finalize_model_loading)


def check_recorded_bundles(model: nn.Module, load_config: Any, loading_info: Any) -> None:
    """Raise CheckpointNeedsBundleError when the checkpoint's record names bundles that did not swap `model` and
    the load shows it. A load with nothing missing, unused or mismatched is complete whatever the record says (a
    bundle of another name serving the same classes), so it passes."""
    value = getattr(getattr(model, "config", None), RECORD_KEY, None)
    if value is None:
        return
    source = str(getattr(load_config, "pretrained_model_name_or_path", None) or "the checkpoint")
    try:
        recorded = parse_record(value, source)
    except BundleError as error:
        warnings.warn(f"{error} Loading it as a stock checkpoint.", LayerswapWarning, stacklevel=5)
        return
    classes = {type(m) for _, m in swapped_modules(model)}
    in_force = {r.bundle.name for r in enabled_records() if classes & r.replacements}
    lacking = [name for name in recorded if name not in in_force]
    missing = sorted(loading_info.missing_keys)
    unexpected = sorted(loading_info.unexpected_keys)
    mismatched = sorted(key for key, *_ in getattr(loading_info, "mismatched_keys", ()))
    if not lacking or not (missing or unexpected or mismatched):
        return
    evidence = "; ".join(
        f"{len(keys)} {what} (e.g. {keys[0]})"
        for what, keys in (
            ("weight(s) the checkpoint lacks, which would be randomly initialised", missing),
            ("checkpoint weight(s) the model has no place for, which would be dropped", unexpected),
            ("weight(s) of another shape", mismatched),
        )
        if keys
    )
    enabled = [r.bundle.name for r in enabled_records()]
    raise CheckpointNeedsBundleError(
        f"{source} was saved under layerswap's {_names(lacking)}, in a layout only {_it(lacking)} loads (its "
        f"config.json's {RECORD_KEY!r} entry records {_it(lacking)}), but {type(model).__name__} was loaded "
        f"without {_it(lacking)} (enabled: {enabled or 'none'}): {evidence}. Load it with "
        f"layerswap.from_pretrained({type(model).__name__}, {source!r}, ...), which enables what the checkpoint "
        f"records, or inside `with layerswap.use_bundle({', '.join(map(repr, lacking))}):`."
    )


def _it(names: list[str]) -> str:
    return "that bundle" if len(names) == 1 else "those bundles"


def _names(names: Iterable[str]) -> str:
    names = list(names)
    return ("bundle " if len(names) == 1 else "bundles ") + ", ".join(repr(n) for n in names)


def watch() -> None:
    """Install the wrappers (layerswap's import does); `unwatch` puts transformers back."""
    if _journal:
        return
    save = vars(PreTrainedModel)["save_pretrained"]
    _journal.set_attribute(PreTrainedModel, "save_pretrained", make_recording_save_pretrained(save))
    config_save = vars(PretrainedConfig)["save_pretrained"]
    _journal.set_attribute(
        PretrainedConfig, "save_pretrained", make_recording_config_save_pretrained(config_save)
    )
    finalize = vars(PreTrainedModel)["_finalize_model_loading"]
    _journal.set_attribute(
        PreTrainedModel, "_finalize_model_loading", make_record_checking_finalize(finalize)
    )


def unwatch() -> None:
    _journal.undo()
