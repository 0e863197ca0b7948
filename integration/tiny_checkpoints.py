"""Tiny random MoE checkpoints, saved locally with a word-level tokenizer, for the integration suite.

Dimensions are multiples of 128, the group size of the common 4-bit schemes (GPTQ W4A16), on every quantized
linear: hidden 128, expert and shared-expert intermediate 128, 4 heads of 32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from layerswap.testing.tiny import tiny_config

FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")  # 2 layers, 8 experts, top_k 2 each
SIZES = {
    "hidden_size": 128,
    "intermediate_size": 128,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "head_dim": 32,
}


def save_tiny_checkpoint(model_type: str, directory: Path, seed: int = 0, **overrides: Any) -> Path:
    """A stock-layout checkpoint of `model_type` (what from_pretrained reads) and its tokenizer, in `directory`;
    `overrides` change the family's tiny config (num_hidden_layers=3, mlp_only_layers=[1], ...)."""
    torch.manual_seed(seed)
    # Only the sizes the family's config has: a key it lacks is still written to config.json, and vLLM reads
    # some of them (a qwen3_moe config with shared_expert_intermediate_size gets a shared expert in vLLM 0.30,
    # left uninitialised as the checkpoint has none: NaN logits).
    defaults = AutoConfig.for_model(model_type)
    sizes = {key: size for key, size in SIZES.items() if hasattr(defaults, key)}
    config = tiny_config(model_type, **{**sizes, **overrides})
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    vocabulary = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0").save_pretrained(
        directory
    )
    return directory


# One prompt every suite runs its models on.
INPUT_IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    """`model`'s logits for INPUT_IDS, in float32."""
    with torch.no_grad():
        return model(INPUT_IDS).logits.float()
