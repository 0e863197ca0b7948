"""A quantizer failing while a bundle loads is reported as the quantizer's error, with its own message: the
checkpoint has the weights, so it must not be reported as missing them. A conversion op failing on weights the
checkpoint lacks stays a missing-weights error, with the op's message."""

import re

import pytest
from transformers import AutoModelForCausalLM

import layerswap
from _support.checkpoints import drop_keys
from _support.tiny_models import tiny_model

QUANTIZER_ERROR = "Int4 packing is not supported on cpu"  # what torchao's int4 op can raise on a CPU


def _int4():
    pytest.importorskip("torchao")
    from torchao.quantization import Int4WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int4WeightOnlyConfig(group_size=32))


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_a_failing_quantize_op_is_the_quantizers_error_not_missing_weights(layout, tmp_path, monkeypatch):
    config = _int4()
    from transformers.integrations.torchao import TorchAoQuantize

    tiny_model("qwen2_moe").save_pretrained(tmp_path, save_original_format=layout == "per-expert")

    def reject(self, *args, **kwargs):
        raise ValueError(QUANTIZER_ERROR)

    monkeypatch.setattr(TorchAoQuantize, "convert", reject)
    with layerswap.use_bundle("qwen2_moe-quant"), pytest.raises(layerswap.WeightConversionError) as error:
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config)
    message = str(error.value)
    assert not isinstance(error.value, layerswap.MissingExpertWeightsError)
    assert isinstance(error.value, RuntimeError)  # what stock transformers raises for the same load
    assert (
        "has the weights" in message
        and "the checkpoint is complete" in message
        and "the torchao quantizer failed" in message
    )
    assert f"ValueError: {QUANTIZER_ERROR}" in message and "TorchAoQuantize" in message
    assert "mlp.experts.0." in message
    assert "Traceback" not in message and "Check that the checkpoint is complete" not in message


def test_torchao_int4_on_this_machine_reports_the_quantizers_own_error(tmp_path):
    # The real case, where torchao's int4 op fails on this machine (a CPU without its kernels): the bundle must
    # report the same failure stock transformers does, with the quantizer's message.
    tiny_model("qwen2_moe").save_pretrained(tmp_path)
    try:
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=_int4())
    except RuntimeError as stock_error:
        assert "conversion" in str(stock_error)
    else:
        pytest.skip("torchao int4 quantizes on this machine: nothing fails")
    with layerswap.use_bundle("qwen2_moe-quant"), pytest.raises(layerswap.WeightConversionError) as error:
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=_int4())
    assert "the torchao quantizer failed" in str(error.value)


def test_a_conversion_op_on_weights_the_checkpoint_lacks_stays_missing_weights_with_the_ops_message(tmp_path):
    # layerswap's own conversions raise on weights the checkpoint lacks: that is a missing weight, not a
    # quantizer failure, and the op's message says which.
    tiny_model("llama").save_pretrained(tmp_path)
    drop_keys(tmp_path, lambda key: key == "model.layers.1.self_attn.k_proj.weight")
    with layerswap.use_bundle("llama-fused_qkv"), pytest.raises(layerswap.MissingExpertWeightsError) as error:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    message = str(error.value)
    assert not isinstance(error.value, layerswap.WeightConversionError)
    assert "Check that the checkpoint is complete" in message
    assert re.search(
        r"While loading, ConcatenateQKV on model\.layers\.1\..* raised ValueError: .*k_proj", message
    )
