"""Loading a checkpoint with the bundles it was saved under, in one call.

A model quantized under a bundle saves its quantized experts one by one, which only that bundle loads back;
`save_pretrained` records the bundles in config.json (`"layerswap": {"bundles": [...], ...}`, see
`_hf/records.py`). `from_pretrained` reads that record and loads under exactly those bundles and options.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from typing import Any

from transformers import PretrainedConfig

from ._hf.records import RECORD_KEY, parse_record
from .errors import BundleError, UnknownBundleError
from .registry import get_bundle, use_bundle

# from_pretrained's arguments that say where config.json is, passed on to read it.
_HUB_ARGUMENTS = (
    "cache_dir",
    "force_download",
    "proxies",
    "token",
    "revision",
    "local_files_only",
    "subfolder",
)


def recorded_bundles(pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any) -> dict[str, dict]:
    """The bundles a checkpoint's config.json records, as {name: options} ({} for a checkpoint saved in the stock
    layout, which needs none). `kwargs` are from_pretrained's: `config` (a config object or path) and the hub
    arguments (revision, subfolder, ...) say where config.json is."""
    source = os.fspath(pretrained_model_name_or_path)
    config = kwargs.get("config")
    if isinstance(config, PretrainedConfig):
        value = getattr(config, RECORD_KEY, None)
    else:
        where = os.fspath(config) if isinstance(config, (str, os.PathLike)) else source
        hub = {name: kwargs[name] for name in _HUB_ARGUMENTS if name in kwargs}
        config_dict, _ = PretrainedConfig.get_config_dict(where, **hub)
        value = config_dict.get(RECORD_KEY)
    if value is None:
        return {}
    recorded = parse_record(value, source)
    for name in recorded:
        try:
            get_bundle(name)
        except UnknownBundleError as error:
            raise UnknownBundleError(
                f"{source}'s config.json records bundle {name!r} (written by layerswap "
                f"{value.get('version') or 'of an unknown version'}), which this layerswap does not have. "
                f"Upgrade layerswap. ({error})"
            ) from None
    return recorded


def from_pretrained(
    model_class: Any,
    pretrained_model_name_or_path: str | os.PathLike,
    /,
    *model_args: Any,
    bundles: tuple[str, ...] | list[str] = (),
    **kwargs: Any,
) -> Any:
    """`model_class.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)` under the bundles the
    checkpoint's config.json records (with their recorded options), and `bundles` besides; each is enabled for
    the call only, as `use_bundle` does. A checkpoint without a record loads as `model_class.from_pretrained`
    loads it (under `bundles`, if any).

        model = layerswap.from_pretrained(AutoModelForCausalLM, "out/qwen2_moe-nf4")
        model = layerswap.from_pretrained(AutoModelForCausalLM, path, bundles=["qwen2_moe-quant"],
                                          quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    """
    if isinstance(model_class, (str, os.PathLike)) or not callable(
        getattr(model_class, "from_pretrained", None)
    ):
        raise BundleError(
            f"layerswap.from_pretrained takes the model class first, then the checkpoint, as in "
            f"layerswap.from_pretrained(AutoModelForCausalLM, {pretrained_model_name_or_path!r}); got "
            f"{model_class!r} as the class."
        )
    if isinstance(bundles, str):
        bundles = (bundles,)
    wanted = recorded_bundles(pretrained_model_name_or_path, **kwargs)
    for name in bundles:
        wanted.setdefault(name, {})
    with ExitStack() as stack:
        for name, options in wanted.items():
            stack.enter_context(use_bundle(name, **options))
        return model_class.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
