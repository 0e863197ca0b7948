"""End to end on the MoE families people quantize most, each with its own auto class: a tiny stock checkpoint
loads under '<family>-quant' with bitsandbytes nf4 (every expert quantized), generates 8 greedy tokens, saves, and
reloads (with the bundle) to the same tokens; unquantized, the bundle generates stock's tokens and its save reloads
in stock transformers bitwise."""

import pytest
import torch

import layerswap
from _support.bnb import quantization_config
from _support.checkpoints import assert_state_dicts_identical
from _support.tiny_models import auto_class, tiny_input_ids, tiny_model

FAMILIES = ["gpt_oss", "llama4", "dbrx", "qwen3_5_moe", "qwen3_vl_moe", "qwen3_omni_moe"]
NEW_TOKENS = 8


def _greedy(model, input_ids):
    # An omni model generates text and speech; text alone here (its talker's experts are checked by the save).
    # Omni models: text only, and the thinker takes its own max_new_tokens (default 1024) over the shared one.
    extra = {"return_audio": False, "thinker_max_new_tokens": NEW_TOKENS} if hasattr(model, "thinker") else {}
    with torch.no_grad():
        output = model.generate(
            input_ids,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            **extra,
        )
    sequences = output[0] if isinstance(output, tuple) else output
    return getattr(sequences, "sequences", sequences)


@pytest.fixture(scope="module", params=FAMILIES)
def stock_checkpoint(request, tmp_path_factory):
    model_type = request.param
    stock = tiny_model(model_type)
    directory = tmp_path_factory.mktemp(model_type)
    stock.save_pretrained(directory)
    return model_type, stock, directory


def test_nf4_generates_and_reloads_to_the_same_tokens(stock_checkpoint, tmp_path):
    model_type, _, directory = stock_checkpoint
    model_class = auto_class(model_type)
    input_ids = tiny_input_ids(batch=1, length=5)
    with layerswap.use_bundle(f"{model_type}-quant"):
        model = model_class.from_pretrained(
            directory, quantization_config=quantization_config("nf4", model_type)
        )
        summary = layerswap.report(model)
        assert summary.expert_params > 0 and summary.expert_quantized_share == 1.0, str(summary)
        model.save_pretrained(tmp_path)  # before any forward: see test_bitsandbytes
        tokens = _greedy(model, input_ids)
        reloaded = model_class.from_pretrained(tmp_path)
        assert layerswap.report(reloaded).expert_quantized_share == 1.0
        assert torch.equal(_greedy(reloaded, input_ids), tokens)
    assert tokens.shape == (1, input_ids.shape[1] + NEW_TOKENS)


def test_unquantized_generates_stock_tokens_and_saves_a_stock_checkpoint(stock_checkpoint, tmp_path):
    model_type, stock, directory = stock_checkpoint
    model_class = auto_class(model_type)
    input_ids = tiny_input_ids(batch=1, length=5)
    with layerswap.use_bundle(f"{model_type}-quant"):
        model, info = model_class.from_pretrained(directory, output_loading_info=True)
        assert not any(info.values()), info
        assert layerswap.report(model).expert_linear_share == 1.0
        assert torch.equal(_greedy(model, input_ids), _greedy(stock, input_ids))
        model.save_pretrained(tmp_path)
    reloaded, info = model_class.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert_state_dicts_identical(stock, reloaded)
