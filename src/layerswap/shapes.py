"""Published model configs (model_shapes.json) and models built from them on the meta device, without weights."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from .errors import BundleError

SHAPES_ENV = "LAYERSWAP_MODEL_SHAPES"


def model_shapes_path() -> Path:
    """The model_shapes.json in use: $LAYERSWAP_MODEL_SHAPES if set, else the copy shipped in the package."""
    override = os.environ.get(SHAPES_ENV)
    if override:
        return Path(override)
    return Path(str(resources.files("layerswap") / "data" / "model_shapes.json"))


def load_model_shapes() -> dict[str, dict[str, Any]]:
    """{model name: published config values}; keys starting with '_' (notes, sources) are left out."""
    path = model_shapes_path()
    if not path.is_file():
        raise BundleError(
            f"No model_shapes.json at {path} (from ${SHAPES_ENV}); point it at a JSON file of "
            "{model name: config values}, or unset it to use the copy shipped with layerswap."
        )
    try:
        entries = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise BundleError(f"{path} is not valid JSON ({error}); fix it or unset ${SHAPES_ENV}.") from None
    return {name: _config_fields(values) for name, values in entries.items() if not name.startswith("_")}


def model_shape(name: str) -> dict[str, Any]:
    """The published config values of one model in model_shapes.json."""
    shapes = load_model_shapes()
    if name not in shapes:
        raise BundleError(f"{name!r} is not in {model_shapes_path()} (known: {', '.join(sorted(shapes))}).")
    return dict(shapes[name])


def _config_fields(values: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in values.items() if not key.startswith("_")}


def resolve_config(config_or_dir: str) -> PretrainedConfig:
    """A config from a directory with config.json, a config.json path, or a model name in model_shapes.json."""
    path = Path(config_or_dir)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        values = json.loads(path.read_text())
    else:
        shapes = load_model_shapes()
        if config_or_dir not in shapes:
            known = ", ".join(sorted(shapes)) or "none found"
            raise BundleError(
                f"{config_or_dir!r} is neither a config.json, a directory with one, nor a model in "
                f"model_shapes.json (known: {known})."
            )
        values = dict(shapes[config_or_dir])
    values = {k: v for k, v in values.items() if k not in ("torch_dtype", "dtype", "architectures")}
    return AutoConfig.for_model(values.pop("model_type"), **values)


def meta_model(config: PretrainedConfig) -> torch.nn.Module:
    """The whole model on the meta device: every module and shape, no memory for weights."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
