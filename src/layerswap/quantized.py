"""Telling quantized layers from full-precision ones, for every quantizer layerswap supports, by class name (no
quantization library needs to be importable)."""

from __future__ import annotations

from torch import nn

# Class names of quantized linear layers that are not nn.Linear subclasses, or hide their quantization there.
_QUANTIZED_LINEAR_NAMES = {
    "Linear4bit",
    "Linear8bitLt",
    "HQQLinear",
    "QLinear",
    "WQLinear_GEMM",
    "QuantLinear",
    "FP8Linear",
}
_QUANTIZED_WEIGHT_NAMES = {
    "Params4bit",
    "Int8Params",
    "AffineQuantizedTensor",
    "LinearActivationQuantizedTensor",
}


def is_quantized_linear(module: nn.Module) -> bool:
    if type(module).__name__ in _QUANTIZED_LINEAR_NAMES:
        return True
    weight = getattr(module, "weight", None)
    if weight is None or not isinstance(module, nn.Linear):
        return False
    return _is_quantized_tensor(weight) or _is_quantized_tensor(getattr(weight, "data", weight))


def _is_quantized_tensor(tensor: object) -> bool:
    # torchao keeps nn.Linear and swaps the weight for a tensor subclass (Int8Tensor, Int4Tensor, Float8Tensor...),
    # all derived from torchao.utils.TorchAOBaseTensor; matched by name so torchao need not be importable.
    names = {cls.__name__ for cls in type(tensor).__mro__}
    return bool(names & (_QUANTIZED_WEIGHT_NAMES | {"TorchAOBaseTensor"}))
