"""transformers' quantizers (`HfQuantizer`), as layerswap adjusts them while a bundle is enabled.

- `get_modules_to_not_convert` gets the bundles' keep-unquantized modules (routers, 1-wide gates).
- `preprocess_model` refuses quantizers that cannot work with a bundle's layout, and makes the quantizer of a model
  with swapped-in modules quantize one weight per call, handing the heap's freed transients back to the OS as it
  goes (`trim_heap`).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from typing import Any

import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer

from ..errors import IncompatibleQuantizerError
from .active import enabled_records, swapped_modules


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc only; elsewhere a no-op).

    Quantizing every expert on CPU allocates and frees a transient per weight, and glibc's growing mmap threshold
    keeps those freed blocks on the heap: a 325 MiB qwen2_moe nf4 load measured, in about one run of two, a peak of
    1.2-1.6 GiB and 1.2 GiB resident after loading, with 94 MiB of live tensors. Trimming while quantizing
    (_quantize_one_weight_per_call) and at the end of the load keeps both at what the weights need."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(AttributeError, OSError):  # not glibc
        ctypes.CDLL(None).malloc_trim(0)


# CPU bytes quantized between two heap trims while loading. On a 325 MiB qwen2_moe nf4 load, trimming every 8 MiB kept
# the peak at 458-487 MiB over 10 loads (without: 460-1620 MiB), for about 5% more load time; every weight, 27% more.
TRIM_EVERY_BYTES = 8 << 20


def _quantize_one_weight_per_call(quantizer: HfQuantizer) -> None:
    """Make this quantizer's quantize ops take one weight per call, and trim the heap every TRIM_EVERY_BYTES of
    CPU weights they quantize (see trim_heap).

    A fused checkpoint's split hands the quantize op every expert of a layer in one dict (64 weights), where stock
    conversions hand it one tensor. torchao's and quanto's ops quantize only the tensor named by
    `full_layer_name` (quanto's reads it as a list), so the other experts would come out missing, and bitsandbytes' op would hold all its
    transients until the end of the call. Patches this one quantizer object, which lives only as long as the model
    it loads; nothing global changes."""
    get_quantize_ops = quantizer.get_quantize_ops
    pending = [0]

    def count(value: Any) -> None:
        # Only CPU weights leave transients on the C heap; quantizing on a GPU needs no trim.
        for tensor in value if isinstance(value, list) else [value]:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                pending[0] += tensor.nbytes
        if pending[0] >= TRIM_EVERY_BYTES:
            pending[0] = 0
            trim_heap()

    def one_weight_per_call(op: Any) -> Any:
        convert = op.convert

        def convert_each(input_dict: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
            if len(input_dict) == 1:
                result = convert(input_dict, *args, **kwargs)
                count(next(iter(input_dict.values())))
                return result
            result = {}
            for key, value in input_dict.items():
                # As a renamed weight reaches it: a list of one tensor (quanto's op reads `value[0]`).
                single = {key: value if isinstance(value, list) else [value]}
                result.update(convert(single, *args, **{**kwargs, "full_layer_name": key}))
                count(value)
            return result

        op.convert = convert_each
        return op

    quantizer.get_quantize_ops = lambda: one_weight_per_call(get_quantize_ops())


def make_skip_aware_modules_to_not_convert(original: staticmethod) -> staticmethod:
    function = original.__func__

    def get_modules_to_not_convert(model: Any, *args: Any, **kwargs: Any) -> list[str]:
        return sorted(set(function(model, *args, **kwargs)) | set(keep_unquantized_modules(model)))

    return staticmethod(get_modules_to_not_convert)


def make_checked_preprocess_model(original: Any) -> Any:
    def preprocess_model(self: HfQuantizer, model: Any, *args: Any, **kwargs: Any) -> Any:
        swapped = swapped_modules(model)
        _refuse_incompatible_quantizer(self, swapped)
        if swapped:
            _quantize_one_weight_per_call(self)
        return original(self, model, *args, **kwargs)

    return preprocess_model


def keep_unquantized_modules(model: nn.Module) -> list[str]:
    """Full names of the modules in `model` that enabled bundles keep out of quantization."""
    model_types = {getattr(getattr(m, "config", None), "model_type", None) for m in model.modules()}
    suffixes: set[str] = set()
    for record in enabled_records():
        bundle, options = record.bundle, record.options
        if model_types.isdisjoint(bundle.model_types):
            continue
        chosen = options.keep_unquantized if options.keep_unquantized is not None else bundle.keep_unquantized
        suffixes.update(chosen)
    if not suffixes:
        return []
    return [
        name
        for name, _ in model.named_modules()
        if name and any(name == s or name.endswith("." + s) for s in suffixes)
    ]


def _refuse_incompatible_quantizer(quantizer: HfQuantizer, swapped: list[tuple[str, nn.Module]]) -> None:
    if type(quantizer).__name__ == "Mxfp4HfQuantizer" and any(
        name.endswith(".experts") for name, _ in swapped
    ):
        raise IncompatibleQuantizerError(
            "This is an MXFP4 checkpoint (quant_method 'mxfp4', gpt-oss's published layout: experts stored as "
            "gate_up_proj_blocks / gate_up_proj_scales), and transformers' MXFP4 path builds or dequantizes the "
            "stock fused experts, which a '-quant' bundle has replaced with per-expert nn.Linear layers. Dequantize "
            "once without the bundle, then load the result with it:\n"
            "    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True), "
            "dtype=torch.bfloat16)\n"
            "    model.save_pretrained(dequantized_path)  # bf16 experts in the stock layout\n"
            "and enable the bundle before `from_pretrained(dequantized_path, ...)`."
        )
    if type(quantizer).__name__ != "FineGrainedFP8HfQuantizer":
        return
    experts = [name for name, m in swapped if name.endswith(".experts") and isinstance(m, nn.ModuleList)]
    if experts:
        raise IncompatibleQuantizerError(
            "transformers' finegrained_fp8 quantizer replaces every module named '*.experts' with its own fused "
            f"3D FP8 experts, which would swallow layerswap's per-expert nn.Linear layers (e.g. {experts[0]}). "
            "finegrained_fp8 already quantizes the stock fused experts: disable the '-quant' bundle for this load "
            "(layerswap.disable_bundle(...)), or use a quantizer that targets nn.Linear (bitsandbytes, torchao, quanto)."
        )


def modules_not_to_convert(model: nn.Module, skip_modules: list[str] | None = None) -> list[str]:
    """The patterns a bitsandbytes quantizer would pass to `replace_with_bnb_linear` for this model, now: the
    layerswap bundles enabled now add their keep-unquantized modules, as they do at load time."""
    patterns = HfQuantizer.get_modules_to_not_convert(
        model,
        list(skip_modules) if skip_modules is not None else None,
        getattr(model, "_keep_in_fp32_modules", None),
    )
    # Idempotent when layerswap's hook is installed; explicit so the result does not hinge on install order.
    return sorted(set(patterns) | set(keep_unquantized_modules(model)))


def keep_in_fp32_strict(model: nn.Module) -> tuple[str, ...]:
    """The parameter-name patterns `model` keeps in fp32 even when loaded in half precision."""
    return tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
