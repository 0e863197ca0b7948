"""Class swapping: transformers' `apply_patches` made exception-safe and cheap, and the swaps that make
`Model(config)` inside `use_bundle` / `apply_bundles` build swapped models.

- transformers' `apply_patches` restores the swapped classes only when the block ends normally; the wrapper
  restores them on every exit, and serialises model construction across threads.
- `PreTrainedModel.post_init` ends every constructor: a swapped model built outside `apply_patches` gets the
  conversions in force and its tensor- and expert-parallel plans rewritten; an unswapped one warns when an
  enabled bundle serves its family.
"""

from __future__ import annotations

import re
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from transformers import monkey_patching

from ..errors import LayerswapWarning
from .active import enabled_records, swapped_modules
from .conversions import remember_conversions
from .parallel import rewrite_parallel_plans
from .records import remember_bundles


def register(class_name: str, replacement: type[nn.Module]) -> None:
    monkey_patching.register_patch_mapping({class_name: replacement})


def unregister(class_name: str) -> None:
    monkey_patching.unregister_patch_mapping([class_name])


def foreign_patches() -> dict[str, type]:
    """Every class transformers' patch mapping replaces now (layerswap's and anyone else's)."""
    return dict(monkey_patching.get_patch_mapping())


# Model construction swaps classes in transformers' module globals, which two threads building at once would
# interleave (one thread's restore un-patching the other's model). Construction is serialised; weights still
# load in parallel.
_BUILD_LOCK = threading.RLock()


def make_exception_safe_apply_patches(original: Any) -> Any:
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


def swap_for_construction(read_replacements: Callable[[], dict[str, type]]) -> list[tuple[str, str]]:
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


def make_checked_post_init(original: Any) -> Any:
    """Every PreTrainedModel's constructor ends in post_init. A model built by its constructor outside
    transformers' apply_patches gets, when swapped (inside `use_bundle` / `apply_bundles`), the conversions in
    force (as from_config's do, so it saves the stock layout after the bundle is disabled); unswapped, a warning
    when an enabled bundle serves its family. Every swapped model, however built, remembers the bundles that
    swapped it."""

    def post_init(self: Any) -> None:
        swapped = swapped_modules(self)
        if swapped:
            tie_swapped_parameters(self, swapped)  # before post_init expands the tie patterns
        original(self)
        if swapped:
            remember_bundles(self, swapped)  # what a save in a layout only they load records (records.py)
        if not getattr(_building, "depth", 0):
            if swapped:
                remember_conversions(self)
                rewrite_parallel_plans(self)
            else:
                _warn_on_unswapped_construction(self)

    return post_init


# Models warned about, so that the outer model of a nested pair (ForCausalLM around Model) does not warn again.
_warned_unswapped: weakref.WeakSet = weakref.WeakSet()


def _warn_on_unswapped_construction(model: nn.Module) -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    records = [
        (record.bundle, record.replacements)
        for record in enabled_records()
        if record.replacements and model_type in record.bundle.model_types
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


# A swapped experts module's parameters, where a tie pattern named one of its stock parameters: any of its
# per-expert projections' weights and biases.
_PER_EXPERT_PARAMETER = r"\d+\.[^.]+\.(?:weight|bias)"


def tie_swapped_parameters(model: nn.Module, swapped: list[tuple[str, nn.Module]]) -> None:
    """Rewrite `model._tied_weights_keys` patterns that end in a swapped experts module's stock parameter name
    (diffusion_gemma ties its decoder's `...experts.gate_up_proj` to its encoder's) to that module's per-expert
    parameters. post_init expands each pattern over the model's parameters and raises when one matches nothing, so
    left as they are, they would make the swapped model unbuildable. Set on the instance: the class keeps its own.
    `swapped`: the model's swapped modules (`swapped_modules(model)`), found once by the caller."""
    mapping = getattr(model, "_tied_weights_keys", None)
    stock_names = {
        name for _, module in swapped for name in getattr(module, "_layerswap_stock_parameter_names", ())
    }
    if not isinstance(mapping, dict) or not stock_names:
        return
    # The name whole: at the pattern's start, or after a dot, a `*` or a group (`(?:[^.]+\\.)*gate_up_proj`).
    names = "|".join(map(re.escape, sorted(stock_names)))
    ending = re.compile(rf"(?:^|(?<=[.*)]))(?:{names})$")
    per_expert = lambda pattern: ending.sub(lambda _: _PER_EXPERT_PARAMETER, pattern)  # noqa: E731
    rewritten = {per_expert(k): per_expert(v) for k, v in mapping.items()}
    if rewritten != mapping:
        model._tied_weights_keys = rewritten
