"""Check that a PEFT adapter (LoRA and kin) fits a model before loading it.

An adapter trained on a '-quant' model holds weights for each expert's nn.Linear
(`model.layers.0.mlp.experts.3.gate_proj.lora_A.weight`). Stock transformers keeps experts as fused 3D tensors
with no such modules, so `PeftModel.from_pretrained` onto a model loaded without the bundle loads none of those
weights: the experts' adapters stay at their random init, with only peft's "missing adapter keys" warning. The
adapter's own keys say which layout it needs, so `check_adapter` needs nothing recorded beside them.

While layerswap is imported, `PeftModel.load_adapter` (and so `PeftModel.from_pretrained`) runs the check itself on
every local adapter (`watch_peft`, undone by `unwatch_peft`).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from ._hf.journal import Journal
from .errors import AdapterLayoutError
from .registry import enabled_bundles, use_bundle

# What PEFT puts around a module's name in an adapter's saved keys.
_PEFT_PREFIX = "base_model.model."
_PEFT_LEAF = re.compile(r"\.(lora_[A-Za-z_]+|ia3_l|oft_r|hra_u|boft_[A-Za-z_]+|vera_lambda_[ab])(\.[\w.]+)?$")
_PER_EXPERT = re.compile(r"(?:^|\.)experts\.\d+\.\w+$")


def adapter_modules(adapter: str | os.PathLike | dict[str, Any]) -> set[str]:
    """The names of the modules an adapter has weights for: from a saved adapter directory, its
    adapter_model.safetensors, or a state dict."""
    if isinstance(adapter, dict):
        keys = list(adapter)
    else:
        from safetensors import safe_open

        path = os.fspath(adapter)
        if os.path.isdir(path):
            path = os.path.join(path, "adapter_model.safetensors")
        with safe_open(path, "pt") as handle:
            keys = list(handle.keys())
    modules = set()
    for key in keys:
        name = _PEFT_LEAF.sub("", key.removeprefix(_PEFT_PREFIX))
        if name != key:
            modules.add(name)
    return modules


def check_adapter(model: nn.Module, adapter: str | os.PathLike | dict[str, Any]) -> None:
    """Raise AdapterLayoutError when `adapter` has weights for modules `model` lacks (PEFT would leave them
    untrained, warning only), naming the bundle that builds them where the adapter needs per-expert nn.Linear
    experts. Call it before `PeftModel.from_pretrained(model, adapter)`; `model` may also be a PeftModel."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    present = {name for name, _ in base.named_modules()}
    missing = sorted(adapter_modules(adapter) - present)
    if not missing:
        return
    source = os.fspath(adapter) if not isinstance(adapter, dict) else "the adapter"
    per_expert = [name for name in missing if _PER_EXPERT.search(name)]
    model_type = getattr(getattr(base, "config", None), "model_type", None) or "<model_type>"
    if per_expert:
        bundle = f"{model_type}-quant"
        advice = (
            f" {len(per_expert)} of them are per-expert nn.Linear layers (e.g. {per_expert[0]}): the adapter was "
            f"trained on experts swapped by the {bundle!r} bundle, which this model does not have. Load the base "
            f"model with that bundle (layerswap.enable_bundle({bundle!r}) before from_pretrained), then the adapter."
        )
    else:
        advice = " The adapter was trained on another model (or another layout of this one)."
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    raise AdapterLayoutError(
        f"{source} has weights for {len(missing)} module(s) that {type(base).__name__} lacks ({shown}); PEFT "
        f"would load none of them and leave them at their random init.{advice}"
    )


# --- checking every adapter PEFT loads -------------------------------------------------------------------------

_PEFT_MODULE = "peft.peft_model"
_journal = Journal()


def watch_peft() -> None:
    """Make PEFT load adapters right onto models layerswap swapped, and refuse the ones that cannot fit.

    `PeftModel.from_pretrained` and `PeftModel.load_adapter` then (1) run `check_adapter` on a local adapter, so an
    adapter whose modules the model lacks is an AdapterLayoutError instead of weights silently left at their random
    init, and (2) load under the checkpoint conversions of the bundles that swapped the model. PEFT renames adapter
    keys by the model's conversions (transformers v5 merges per-expert keys into fused experts); after the bundle
    was disabled it would rename a '-quant' adapter's per-expert keys to fused names the swapped model does not
    have, and load none of them. Called when layerswap is imported: at once if peft is imported already, else when
    it is. `unwatch_peft()` puts PEFT back."""
    for name, wrap in ((_PEFT_MODULE, _wrap_peft), (_PEFT_CONVERSION_MODULE, _keep_per_expert_targets)):
        module = sys.modules.get(name)
        if module is not None:
            wrap(module)
        elif not any(isinstance(f, _WrapPeftOnImport) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _WrapPeftOnImport(name, wrap))


def unwatch_peft() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _WrapPeftOnImport)]
    _journal.undo()


class _WrapPeftOnImport(importlib.abc.MetaPathFinder):
    """Runs `wrap` on PEFT's module `name` once that module has run (`PeftModel.load_adapter` in peft.peft_model;
    the config rewrite in peft.utils.transformers_weight_conversion, which cannot be imported while peft.peft_model
    is: a circular import)."""

    def __init__(self, name: str, wrap: Any) -> None:
        self.name, self.wrap = name, wrap

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name:
            return None
        unwatch_import = [f for f in sys.meta_path if f is not self]
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        sys.meta_path[:] = unwatch_import  # one module, once
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            self.wrap(module)

        spec.loader.exec_module = exec_module
        return spec


def _wrap_peft(module: Any) -> None:
    peft_model = getattr(module, "PeftModel", None)
    if not isinstance(peft_model, type) or hasattr(
        vars(peft_model).get("load_adapter"), "_layerswap_checked"
    ):
        return
    load_adapter = vars(peft_model).get("load_adapter")
    from_pretrained = vars(peft_model).get("from_pretrained")
    if load_adapter is not None:

        @functools.wraps(load_adapter)
        def checked_load_adapter(self: Any, model_id: Any, *args: Any, **kwargs: Any) -> Any:
            adapter = _local_adapter_file(model_id, kwargs.get("subfolder"))
            if adapter is not None:
                check_adapter(self, adapter)
            with _conversions_of(self):
                return load_adapter(self, model_id, *args, **kwargs)

        checked_load_adapter._layerswap_checked = True
        _journal.set_attribute(peft_model, "load_adapter", checked_load_adapter)
    if isinstance(from_pretrained, classmethod):
        function = from_pretrained.__func__

        @functools.wraps(function)
        def checked_from_pretrained(cls: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
            with _conversions_of(model):
                return function(cls, model, *args, **kwargs)

        _journal.set_attribute(peft_model, "from_pretrained", classmethod(checked_from_pretrained))


_PEFT_CONVERSION_MODULE = "peft.utils.transformers_weight_conversion"
_PEFT_CONVERT_CONFIG = "convert_peft_config_for_transformers"


def _keep_per_expert_targets(conversion: Any) -> None:
    """PEFT rewrites a LoRA config's transformers-v4 expert names (mixtral's w1/w3/w2, qwen2_moe's and its copies'
    gate_proj/up_proj/down_proj) into the v5 fused parameters (`target_parameters` gate_up_proj, down_proj) for
    the model types whose experts v5 fused. A model whose experts a '-quant' bundle swapped has those per-expert
    modules, and no fused parameters: the rewrite left PEFT nothing to target ("No `target_modules` passed but
    also no `target_parameters` found"). For such a model the config stays as written."""
    convert = vars(conversion).get(_PEFT_CONVERT_CONFIG)
    if convert is None or hasattr(convert, "_layerswap_checked"):  # a PEFT without the rewrite, or wrapped
        return

    @functools.wraps(convert)
    def convert_unless_per_expert(peft_config: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        modules = model.modules() if isinstance(model, nn.Module) else ()
        if any(getattr(type(m), "_layerswap_per_expert_modules", False) for m in modules):
            return None
        return convert(peft_config, model, *args, **kwargs)

    convert_unless_per_expert._layerswap_checked = True
    _journal.set_attribute(conversion, _PEFT_CONVERT_CONFIG, convert_unless_per_expert)


@contextmanager
def _conversions_of(model: Any) -> Iterator[None]:
    """The checkpoint conversions of the bundles whose swapped modules re-lay `model`'s weights out, in force for
    the block (those not enabled now are enabled for it)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    modules = base.modules() if isinstance(base, nn.Module) else ()
    bundles = {getattr(type(m), "_layerswap_bundle", None) for m in modules} - {None}
    missing = sorted(bundles - set(enabled_bundles()))
    if not missing:
        yield
        return
    with use_bundle(*missing):
        yield


def _local_adapter_file(model_id: Any, subfolder: str | None) -> str | None:
    """The adapter_model.safetensors of a local adapter directory, or None (a hub id, or weights in another
    format: PEFT loads those unchecked, as before)."""
    if not isinstance(model_id, (str, os.PathLike)):
        return None
    directory = os.path.join(os.fspath(model_id), subfolder or "")
    path = os.path.join(directory, "adapter_model.safetensors")
    return path if os.path.isfile(path) else None
