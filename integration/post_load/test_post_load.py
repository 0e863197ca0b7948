"""torchao `quantize_` and quanto `quantize` + `freeze` applied after loading (not through a transformers
quantization config), to tiny MoE models loaded stock and under '<family>-quant'.

Both convert nn.Linear layers only: a stock v5 model keeps its experts in fused 3D parameters, so none of them is
quantized; under the bundle every expert projection is an nn.Linear, so all of them are.
"""

from __future__ import annotations

import pytest
import torch
from optimum.quanto import freeze, qint8
from optimum.quanto import quantize as quanto_quantize
from torch import nn
from torchao.quantization import Int8WeightOnlyConfig, quantize_
from transformers import AutoModelForCausalLM

import layerswap
from tiny_checkpoints import logits

# int8 weight-only of tiny random weights: a few percent of the logits' range.
MAX_RELATIVE_LOGIT_ERROR = 0.1


def _torchao_int8(model: nn.Module) -> None:
    quantize_(model, Int8WeightOnlyConfig())


def _quanto_int8(model: nn.Module) -> None:
    quanto_quantize(model, weights=qint8)
    freeze(model)


QUANTIZERS = {"torchao-int8": _torchao_int8, "quanto-int8": _quanto_int8}


def _load(path, model_type: str, bundle: bool) -> nn.Module:
    if not bundle:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with layerswap.use_bundle(f"{model_type}-quant"):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_post_load_quantization_converts_every_expert_only_under_the_bundle(tiny_checkpoint, quantizer):
    model_type, path = tiny_checkpoint
    stock, bundled = _load(path, model_type, bundle=False), _load(path, model_type, bundle=True)
    expected = logits(stock)
    for model in (stock, bundled):
        QUANTIZERS[quantizer](model)
    assert layerswap.report(stock).expert_quantized_share == 0.0
    assert layerswap.report(bundled).expert_quantized_share == 1.0
    error = ((logits(bundled) - expected).abs().max() / expected.abs().max()).item()
    assert error < MAX_RELATIVE_LOGIT_ERROR
