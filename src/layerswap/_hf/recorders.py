"""Output recorders: the `_can_record_outputs` dicts through which models return attentions and router logits.

- transformers' `patch_output_recorders` rewrites them in place for the classes a bundle swapped, and nothing in
  transformers undoes it. The wrapper journals every dict and recorder before it is rewritten (disabling the last
  bundle restores them), and keeps stock-built models of those classes recorded.
- `add_router_output_recorder` records one more router output (the '-replay' bundles' selected experts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from transformers.utils import output_capturing
from transformers.utils.output_capturing import OutputRecorder

from ..errors import UnsupportedTransformersError
from .compat import TRANSFORMERS_VERSION
from .conversions import remember_conversions
from .journal import Journal
from .parallel import rewrite_parallel_plans

# The recorder dicts and recorders as they were before the first rewrite since a bundle was enabled.
_journal = Journal()


def _journal_recorders(model: nn.Module) -> None:
    for module in model.modules():
        recorders = getattr(type(module), "_can_record_outputs", None)
        if isinstance(recorders, dict) and _journal.remember_contents(recorders):
            for value in recorders.values():
                for recorder in value if isinstance(value, list) else [value]:
                    if isinstance(recorder, OutputRecorder):
                        _journal.remember_attribute(recorder, "target_class")


def restore_output_recorders() -> None:
    _journal.undo()


def make_journaling_patch_output_recorders(original: Any) -> Any:
    """transformers calls patch_output_recorders right after building a model (from_config and from_pretrained):
    the one point where layerswap sees every freshly built model."""

    def patch_output_recorders(model: nn.Module) -> None:
        _journal_recorders(model)
        remember_conversions(model)
        before = _recorders_of(model)
        with _tuple_targets_set_aside(model):
            original(model)
        _keep_stock_classes_recorded(before)
        rewrite_parallel_plans(model)

    return patch_output_recorders


class _SetAside:
    """Stands in for a recorder's tuple of target classes while transformers rewrites recorders: it names no class
    a patch mapping has."""


@contextlib.contextmanager
def _tuple_targets_set_aside(model: nn.Module) -> Iterator[None]:
    """transformers (to 5.24 at least) reads `recorder.target_class.__name__`, which fails on a recorder whose target
    is a tuple of classes (inkling2_loop records hidden states off four decoder-layer classes), so no model with
    one could be built with any class patched. Such recorders keep their tuple: layerswap swaps none of the classes
    a tuple names (decoder layers), and a swapped subclass would still be recorded by its stock class."""
    set_aside = [
        (recorder, recorder.target_class)
        for module in model.modules()
        for value in (getattr(type(module), "_can_record_outputs", None) or {}).values()
        for recorder in (value if isinstance(value, list) else [value])
        if isinstance(recorder, OutputRecorder) and isinstance(recorder.target_class, tuple)
    ]
    for recorder, _ in set_aside:
        recorder.target_class = _SetAside
    try:
        yield
    finally:
        for recorder, targets in set_aside:
            recorder.target_class = targets


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


# --- one more router output -------------------------------------------------------------------------------


def add_router_output_recorder(modeling_module: str, router: str | None, key: str) -> Callable[[], None]:
    """Record output 2 of the router class `router` (its expert indices) as `key`, beside the `router_logits`
    (output 0) the classes of `modeling_module` record; returns the exact undo."""
    module = importlib.import_module(modeling_module)
    edited: list[tuple[type, dict, dict]] = []
    for cls in list(vars(module).values()):
        if not isinstance(cls, type) or cls.__module__ != module.__name__:
            continue
        recorders = cls.__dict__.get("_can_record_outputs")
        if isinstance(recorders, dict) and _records_the_router(recorders.get("router_logits"), router):
            replacement = {**recorders, key: _index_2_recorder(recorders["router_logits"], cls)}
            cls._can_record_outputs = replacement
            edited.append((cls, recorders, replacement))
    router_class = getattr(module, router or "", None)
    if not edited and isinstance(router_class, type):
        # Releases whose model records no 'router_logits' off its router yet (deepseek_v3, glm4_moe, ... before
        # 5.19; exaone_moe's came off its MoE block; granitemoe's before 5.18): record output 2 of the router
        # class itself, beside what the model records.
        for cls in list(vars(module).values()):
            recorders = cls.__dict__.get("_can_record_outputs") if isinstance(cls, type) else None
            if isinstance(recorders, dict) and cls.__module__ == module.__name__:
                recorder = OutputRecorder(getattr(router_class, "_layerswap_original", router_class), index=2)
                replacement = {**recorders, key: recorder}
                cls._can_record_outputs = replacement
                edited.append((cls, recorders, replacement))
    if not edited:
        raise UnsupportedTransformersError(
            f"{modeling_module} in transformers {TRANSFORMERS_VERSION} has no class recording "
            f"'router_logits', which the '-replay' bundle extends with {key!r}; please report it."
        )

    def restore() -> None:
        registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", {})
        for cls, original, replacement in reversed(edited):
            cls._can_record_outputs = original
            # Models built meanwhile registered our dict by class name; point them back at the stock one.
            for name, value in list(registry.items()):
                if value is replacement:
                    dict.__setitem__(registry, name, original)

    return restore


def _records_the_router(recorder: Any, router_name: str | None) -> bool:
    target = recorder.target_class if isinstance(recorder, OutputRecorder) else recorder
    target = getattr(target, "_layerswap_original", target)
    return isinstance(target, type) and target.__name__ == router_name


def _index_2_recorder(router_logits: Any, owner: type) -> OutputRecorder:
    if isinstance(router_logits, OutputRecorder):
        target = router_logits.target_class
        target = getattr(target, "_layerswap_original", target)  # a recorder a load left patched
        return dataclasses.replace(router_logits, target_class=target, index=2)
    if isinstance(router_logits, type):
        return OutputRecorder(getattr(router_logits, "_layerswap_original", router_logits), index=2)
    raise UnsupportedTransformersError(
        f"{owner.__qualname__}._can_record_outputs['router_logits'] is {router_logits!r} in transformers "
        f"{TRANSFORMERS_VERSION}, not an OutputRecorder or class; the '-replay' bundle cannot add a recorder "
        "beside it. Please report it."
    )
