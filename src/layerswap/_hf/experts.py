"""transformers' experts implementations: the interface layerswap's fused backend registers in, the layout flags
of a stock Experts module, and `set_experts_implementation` checked against swapped experts."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from torch import nn
from transformers.integrations import moe as hf_moe

from .active import swapped_modules

# What `@use_experts_implementation` records on an Experts module of the stock fused layout (gate_up_proj
# [E, 2I, H] gate rows first, down_proj [E, H, I], no bias, one process per expert set), with the release that
# added each flag. A release without a flag has the stock value.
STOCK_LAYOUT_FLAGS: dict[str, tuple[bool, str]] = {
    "has_gate": (True, "5.0"),
    "has_bias": (False, "5.0"),
    "is_transposed": (False, "5.0"),
    "is_concatenated": (True, "5.7"),
    "has_post_expert_norm": (False, "5.20"),
    "_is_expert_parallel": (False, "5.18"),
}


def layout_mismatches(module: nn.Module, expert_parallel_ok: bool = False) -> list[tuple[str, Any, bool]]:
    """(flag, value found, stock value) for each layout flag of `module` that is not the stock one; with
    `expert_parallel_ok`, sharded experts (under expert parallelism) count as the stock layout."""
    found = [
        (flag, getattr(module, flag, stock), stock)
        for flag, (stock, _) in STOCK_LAYOUT_FLAGS.items()
        if not (expert_parallel_ok and flag == "_is_expert_parallel")
    ]
    return [(flag, value, stock) for flag, value, stock in found if value != stock]


def overrides_apply_gate(experts_class: type) -> bool:
    """True when the class computes its gate other than act(gate) * up (a clamped or interleaved gate)."""
    default = hf_moe._default_apply_gate
    return getattr(experts_class, "_apply_gate", default) is not default


def own_gate(experts_class: type) -> Callable[[Any, Any], Any] | None:
    """The class's own `_apply_gate(self, gate_up)` where it overrides the stock one, else None."""
    return experts_class._apply_gate if overrides_apply_gate(experts_class) else None


def configured_implementation(config: Any) -> str | None:
    """The experts implementation `config` names now (None: transformers' default)."""
    return getattr(config, "_experts_implementation", None)


_MISSING = object()
_backend_lock = threading.Lock()
_backends: dict[str, object] = {}  # name -> what the interface's local mapping held under it before


def register_backend(name: str, forward: Callable[..., Any]) -> None:
    """Make `experts_implementation=name` run `forward`. Idempotent; the first call records what it hides."""
    with _backend_lock:
        if name in _backends:
            return
        # The instance's local mapping is what every Experts class and from_pretrained look up first; the
        # class-level ExpertsInterface.register would be shadowed by a local entry of the same name.
        _backends[name] = hf_moe.ALL_EXPERTS_FUNCTIONS._local_mapping.get(name, _MISSING)
        hf_moe.ALL_EXPERTS_FUNCTIONS[name] = forward


def unregister_backend(name: str) -> None:
    """Undo `register_backend` exactly: the entry it replaced comes back, or the name goes away."""
    with _backend_lock:
        if name not in _backends:
            return
        saved = _backends.pop(name)
        local = hf_moe.ALL_EXPERTS_FUNCTIONS._local_mapping
        if saved is _MISSING:
            local.pop(name, None)
        else:
            local[name] = saved


# --- set_experts_implementation --------------------------------------------------------------------------

# Set in a swapped experts module's __dict__ once set_experts_implementation chose its implementation.
EXPERTS_IMPLEMENTATION_CHOSEN = "_layerswap_experts_implementation_chosen"


def make_checked_set_experts_implementation(original: Any) -> Any:
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
