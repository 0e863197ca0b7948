"""Check that a PEFT adapter (LoRA and kin) fits a model before loading it.

An adapter trained on a '-quant' model holds weights for each expert's nn.Linear
(`model.layers.0.mlp.experts.3.gate_proj.lora_A.weight`). Stock transformers keeps experts as fused 3D tensors
with no such modules, so `PeftModel.from_pretrained` onto a model loaded without the bundle loads none of those
weights: the experts' adapters stay at their random init, with only peft's "missing adapter keys" warning. The
adapter's own keys say which layout it needs, so `check_adapter` needs nothing recorded beside them.
"""

from __future__ import annotations

import os
import re
from typing import Any

from torch import nn

from .errors import AdapterLayoutError

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
