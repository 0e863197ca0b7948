"""Swapped modules offloaded by accelerate: `device_map="auto"` with a CPU budget of half the model, so part of
it lives on disk and streams in through hooks. Loads, runs, generates and saves back the stock layout. With
bitsandbytes nf4, what stock transformers itself cannot do on CPU (run a disk-offloaded 4-bit model twice, save
it after a forward pass) is shown as expected failures, with and without the bundle."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM

import layerswap
from _support.checkpoints import checkpoint_factory
from _support.tiny_models import tiny_input_ids

pytest.importorskip("accelerate")

MODEL_TYPES = ("qwen3_moe", "mixtral")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_factory(tmp_path_factory)


def _model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _offloaded(path, tmp_path, budget_fraction, **kwargs):
    """The model under the enabled bundles with a CPU budget of `budget_fraction` of its fp32 size."""
    size = _model_bytes(AutoModelForCausalLM.from_pretrained(path))
    budget = {"max_memory": {"cpu": int(size * budget_fraction)}, "offload_folder": tmp_path / "offload"}
    return AutoModelForCausalLM.from_pretrained(path, device_map="auto", **budget, **kwargs).eval()


@pytest.mark.parametrize("purpose", ["quant", "fast"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_offloaded_to_cpu_and_disk_runs_generates_and_saves_the_stock_layout(
    checkpoint, tmp_path, model_type, purpose
):
    path = checkpoint(model_type)
    stock = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tiny_input_ids()
    with layerswap.use_bundle(f"{model_type}-{purpose}"):
        model = _offloaded(path, tmp_path, 0.5)
        assert {"cpu", "disk"} <= set(model.hf_device_map.values()), model.hf_device_map
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, stock(ids).logits, atol=1e-5, rtol=1e-5)
        generated = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
        model.save_pretrained(tmp_path / "saved")
    assert torch.equal(generated, stock.generate(ids[:1], max_new_tokens=4, do_sample=False))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    expected, actual = stock.state_dict(), reloaded.state_dict()
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[k], actual[k]) for k in expected)


def _nf4():
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    # bitsandbytes refuses CPU/disk placement of 4-bit models unless the offloaded modules stay fp32.
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", llm_int8_enable_fp32_cpu_offload=True
    )


@pytest.mark.xfail(
    raises=NotImplementedError,
    strict=True,
    reason="transformers 5.24 with bitsandbytes 0.50 on CPU: a 4-bit model offloaded to disk runs one forward "
    "pass, and the next one fails bringing a 4-bit weight back from disk ('Cannot copy out of meta tensor'), with "
    "or without a bundle",
)
@pytest.mark.parametrize("bundles", [(), ("qwen3_moe-quant",)], ids=["stock", "quant"])
def test_nf4_offloaded_to_disk_generates(checkpoint, tmp_path, bundles):
    path = checkpoint("qwen3_moe")
    ids = tiny_input_ids()
    with layerswap.use_bundle(*bundles) if bundles else contextlib.nullcontext():
        model = _offloaded(path, tmp_path, 0.125, quantization_config=_nf4())
        assert "disk" in model.hf_device_map.values(), model.hf_device_map
        with torch.no_grad():
            assert torch.isfinite(model(ids).logits).all()
        assert model.generate(ids[:1], max_new_tokens=4, do_sample=False).shape == (1, ids.shape[1] + 4)


@pytest.mark.xfail(
    raises=AttributeError,
    strict=True,
    reason="transformers 5.24 cannot save a bitsandbytes 4-bit model with weights offloaded to disk once it has "
    "run a forward pass ('`weight` is not an nn.Module'), with or without a bundle",
)
@pytest.mark.parametrize("bundles", [(), ("qwen3_moe-quant",)], ids=["stock", "quant"])
def test_saving_an_nf4_model_offloaded_to_disk(checkpoint, tmp_path, bundles):
    path = checkpoint("qwen3_moe")
    with layerswap.use_bundle(*bundles) if bundles else contextlib.nullcontext():
        # An eighth of the fp32 size puts the stock model (experts not quantized) wholly on disk, the -quant one
        # on CPU and disk.
        model = _offloaded(path, tmp_path, 0.125, quantization_config=_nf4())
        assert "disk" in model.hf_device_map.values()
        with torch.no_grad():
            model(tiny_input_ids())  # saving before any forward pass works
        model.save_pretrained(tmp_path / "saved")
