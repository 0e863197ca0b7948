"""Enable and disable bundles: register their patches and conversions in transformers (through `_hf`), and put
back exactly what was there before. All registry work holds one lock."""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ._hf import active, hooks, patching, recorders
from ._hf import conversions as hf_conversions
from ._hf.compat import TRANSFORMERS_VERSION, refuse_unsupported
from .bundle import Bundle, BundleOptions, EnabledRecord, Patch
from .catalog import CATALOG
from .errors import (
    BundleConflictError,
    BundleError,
    UnknownBundleError,
    UnsupportedTransformersError,
    closest_names,
)

_LOCK = threading.RLock()


@dataclass
class _EnabledBundle:
    bundle: Bundle
    options: BundleOptions
    replacements: dict[str, type[nn.Module]]
    restorers: list[Any] = field(default_factory=list)


@dataclass
class _PatchOwner:
    replacement: type[nn.Module]
    bundles: list[str] = field(default_factory=list)


_enabled: dict[str, _EnabledBundle] = {}
# Bundles enabled by enable_bundle (they outlive any use_bundle block), and open use_bundle blocks per bundle.
_explicit: set[str] = set()
_scoped_uses: dict[str, int] = {}
_patch_owners: dict[str, _PatchOwner] = {}
# (adapter, original class, options) -> replacement: enabling twice gives the very same class.
_adapter_cache: dict[tuple[Any, type, BundleOptions], type[nn.Module]] = {}


def get_bundle(name: str) -> Bundle:
    if not isinstance(name, str):
        raise BundleError(f"A bundle name is a string such as 'qwen2_moe-quant', got {type(name).__name__}.")
    try:
        return CATALOG[name]
    except KeyError:
        raise UnknownBundleError(f"No bundle named {name!r}. {closest_names(name, CATALOG)}") from None


def list_bundles() -> list[Bundle]:
    return list(CATALOG.values())


def enabled_bundles() -> tuple[str, ...]:
    with _LOCK:
        return tuple(_enabled)


def enabled_records() -> tuple[EnabledRecord, ...]:
    """Each enabled bundle with its options and the replacement classes it registered, in enable order."""
    with _LOCK:
        return tuple(
            EnabledRecord(e.bundle, e.options, frozenset(e.replacements.values())) for e in _enabled.values()
        )


active.connect(enabled_records)


def enable_bundle(name: str, **options: Any) -> Bundle:
    """Enable `name` before `from_pretrained` / `from_config`.

    Enabling an enabled bundle again with the same options does nothing; with other options it raises
    BundleError (disable it first).
    """
    with _LOCK:
        bundle = _enable(name, options)
        _explicit.add(name)
    return bundle


def _enable(name: str, options: dict[str, Any]) -> Bundle:
    bundle = get_bundle(name)
    refuse_unsupported(bundle)  # an internal this kind of bundle needs is missing
    resolved = bundle.make_options(options)
    with _LOCK:
        current = _enabled.get(name)
        if current is not None:
            if current.options == resolved:
                return bundle
            raise BundleError(
                f"Bundle {name!r} is already enabled with {current.options}; call "
                f"layerswap.disable_bundle({name!r}) before enabling it with {resolved}."
            )
        replacements = {
            patch.class_name: _build_replacement(bundle, patch, resolved) for patch in bundle.patches
        }
        _check_conflicts(bundle, replacements)
        if not _enabled:
            hooks.install()
        try:
            for class_name, replacement in replacements.items():
                owner = _patch_owners.get(class_name)
                if owner is None:
                    patching.register(class_name, replacement)
                    owner = _patch_owners[class_name] = _PatchOwner(replacement)
                owner.bundles.append(name)
            record = _enabled[name] = _EnabledBundle(bundle, resolved, replacements)
            for model_type in bundle.conversions:
                hf_conversions.sync(model_type)
            for install in bundle.installers:
                record.restorers.append(install(resolved))
        except BaseException:
            _disable_locked(name, missing_ok=True)
            raise
    return bundle


def disable_bundle(name: str) -> None:
    """Disable `name`, restoring exactly the transformers state it changed. Disabling a bundle that is not
    enabled raises BundleError."""
    get_bundle(name)
    with _LOCK:
        if name not in _enabled:
            raise BundleError(
                f"Bundle {name!r} is not enabled (enabled: {list(_enabled) or 'none'}); nothing to disable."
            )
        _disable_locked(name)


def disable_all() -> None:
    with _LOCK:
        for name in reversed(list(_enabled)):
            _disable_locked(name)


@contextmanager
def use_bundle(*names: str, **options: Any) -> Iterator[tuple[str, ...]]:
    """Enable `names` for the block and disable them on exit, even when the block raises.

    Scopes are counted per bundle, so overlapping blocks (in several threads, say) keep a bundle enabled until
    the last one ends; a bundle enabled with enable_bundle before the block stays enabled after it.
    """
    entered: list[str] = []
    swapped: list[tuple[str, str]] = []
    try:
        for name in names:
            with _LOCK:
                _enable(name, options)
                _scoped_uses[name] = _scoped_uses.get(name, 0) + 1
            entered.append(name)
        swapped = patching.swap_for_construction(lambda: _replacements_of(names))
        yield names
    finally:
        patching.unswap_for_construction(swapped)  # before _LOCK: builds take the build lock, then _LOCK
        with _LOCK:
            for name in reversed(entered):
                _scoped_uses[name] -= 1
                if _scoped_uses[name] == 0:
                    del _scoped_uses[name]
                    if name in _enabled and name not in _explicit:
                        _disable_locked(name)


@contextmanager
def apply_bundles() -> Iterator[tuple[str, ...]]:
    """Swap the enabled bundles' classes in transformers for the block, so that models built by their constructor
    (`Model(config)`) inside it are swapped as from_pretrained and from_config swap them; yields the names of
    the bundles in force. (`use_bundle` does the same for its own bundles.) A model built by its constructor while
    a bundle of its family is enabled, outside such a block, stays stock, with a LayerswapWarning."""
    names = enabled_bundles()
    swapped = patching.swap_for_construction(lambda: _replacements_of(names))
    try:
        yield names
    finally:
        patching.unswap_for_construction(swapped)


def _replacements_of(names: tuple[str, ...]) -> dict[str, type[nn.Module]]:
    with _LOCK:
        return {
            class_name: replacement
            for name in names
            if name in _enabled
            for class_name, replacement in _enabled[name].replacements.items()
        }


def _disable_locked(name: str, missing_ok: bool = False) -> None:
    """Undo `name`; with `missing_ok`, also the partial work of an enable that failed half-way."""
    _explicit.discard(name)
    record = _enabled.pop(name, None)
    if record is None and not missing_ok:
        raise BundleError(f"Bundle {name!r} is not enabled.")
    bundle = record.bundle if record else get_bundle(name)
    for restore in reversed(record.restorers if record else []):
        restore()
    for class_name in list(_patch_owners):
        owner = _patch_owners[class_name]
        if name in owner.bundles:
            owner.bundles.remove(name)
            if not owner.bundles:
                patching.unregister(class_name)
                del _patch_owners[class_name]
    for model_type in bundle.conversions:
        hf_conversions.sync(model_type)
    # Output recorders are restored on every disable: a later load re-patches them for the bundles still enabled.
    recorders.restore_output_recorders()
    if not _enabled:
        hooks.uninstall()


def _build_replacement(bundle: Bundle, patch: Patch, options: BundleOptions) -> type[nn.Module]:
    original = _import_original(bundle, patch)
    key = (patch.adapter, original, options)
    replacement = _adapter_cache.get(key)
    if replacement is None:
        replacement = patch.adapter(original, options)
        _check_replacement_contract(original, replacement)
        _adapter_cache[key] = replacement
    return replacement


def _import_original(bundle: Bundle, patch: Patch) -> type[nn.Module]:
    try:
        module = importlib.import_module(patch.module)
    except ImportError as error:
        raise UnsupportedTransformersError(
            f"Bundle {bundle.name!r} needs module {patch.module}, which transformers {TRANSFORMERS_VERSION} "
            f"does not have ({error}). Upgrade transformers or pick another bundle."
        ) from error
    original = getattr(module, patch.class_name, None)
    if not isinstance(original, type):
        raise UnsupportedTransformersError(
            f"Bundle {bundle.name!r} replaces {patch.module}.{patch.class_name}, but transformers "
            f"{TRANSFORMERS_VERSION} has no such class. Upgrade transformers or pick another bundle."
        )
    # Inside `apply_patches` the module attribute is already our replacement; we want the stock class.
    return getattr(original, "_layerswap_original", original)


def _check_replacement_contract(original: type[nn.Module], replacement: type[nn.Module]) -> None:
    """The replacement's forward accepts the stock forward's arguments, by the same names, in the same order."""
    stock = _positional_names(original.forward)
    ours = _positional_names(replacement.forward)
    if ours[: len(stock)] != stock:
        raise BundleError(
            f"{replacement.__qualname__}.forward{ours} does not match the forward{stock} of "
            f"{original.__module__}.{original.__qualname__} it replaces."
        )


def _positional_names(function: Any) -> tuple[str, ...]:
    parameters = inspect.signature(function).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in parameters if p.kind in kinds and p.name != "self")


def _check_conflicts(bundle: Bundle, replacements: dict[str, type[nn.Module]]) -> None:
    foreign = patching.foreign_patches()
    for class_name, replacement in replacements.items():
        owner = _patch_owners.get(class_name)
        if owner is not None and owner.replacement is not replacement:
            raise BundleConflictError(
                f"Bundle {bundle.name!r} and bundle {owner.bundles[0]!r} both replace {class_name}, "
                f"with {replacement.__qualname__} and {owner.replacement.__qualname__}. Enable only one of them."
            )
        if owner is None and class_name in foreign:
            raise BundleConflictError(
                f"Bundle {bundle.name!r} replaces {class_name}, but a patch registered outside layerswap "
                f"already replaces it with {foreign[class_name].__qualname__}. Remove it with "
                f"transformers.monkey_patching.unregister_patch_mapping([{class_name!r}]) first."
            )
