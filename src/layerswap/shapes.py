"""Published model configs (model_shapes.json) and models built from them on the meta device, without weights."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from ._errors import BundleError


def model_shapes_path() -> Path:
    """$LAYERSWAP_MODEL_SHAPES, else ../shared/model_shapes.json beside the working directory or the repo."""
    if "LAYERSWAP_MODEL_SHAPES" in os.environ:
        return Path(os.environ["LAYERSWAP_MODEL_SHAPES"])
    candidates = [Path.cwd() / "../shared/model_shapes.json", Path(__file__).resolve().parents[3] / "../shared/model_shapes.json"]
    for candidate in candidates:
        if candidate.exists():
            return candidate.resolve()
    return candidates[0]


def load_model_shapes() -> dict[str, dict[str, Any]]:
    path = model_shapes_path()
    if not path.exists():
        raise BundleError(f"No model_shapes.json at {path}; set LAYERSWAP_MODEL_SHAPES to its path.")
    return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}


def resolve_config(config_or_dir: str) -> PretrainedConfig:
    """A config from a directory with config.json, a config.json path, or a model name in model_shapes.json."""
    path = Path(config_or_dir)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        values = json.loads(path.read_text())
    else:
        shapes = load_model_shapes() if model_shapes_path().exists() else {}
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
