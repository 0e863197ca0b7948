"""Tiny random configs for every family in the catalog (the demo's and the tests'), built locally.

Dimensions respect bitsandbytes' CPU 4-bit kernels: every quantized linear has out_features % 32 == 0 and
in_features >= 64 (hidden 64, intermediate 64/128, head_dim 16).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForMultimodalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForTokenClassification,
    PretrainedConfig,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
)

from ._sizes import VOCAB

# Attributes that shrink a config, set only where the family's config has them.
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64,  # nemotron_h
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}

# Multi-head latent attention (deepseek_v3's and its descendants'): small ranks, as many kv heads as heads, every
# layer MoE so both layers have experts.
_MLA: dict[str, Any] = {
    "num_key_value_heads": 4,
    "first_k_dense_replace": 0,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
}
# Sparse (indexed) attention on top of MLA: a small indexer.
_INDEXED = {"index_topk": 4, "index_head_dim": 16, "index_n_heads": 2}

# Per-family settings on top of _COMMON, each with the reason it is needed.
_FAMILY: dict[str, dict[str, Any]] = {
    "axk1": {**_MLA, "mlp_layer_types": ["sparse", "sparse"]},
    "axk2": {**_MLA, **_INDEXED, "mlp_layer_types": ["sparse", "sparse"]},
    "deepseek_v32": {**_MLA, **_INDEXED},
    "glm_moe_dsa": {**_MLA, **_INDEXED},
    # Also: the default pad id is beyond the tiny vocabulary.
    "hy_v4": {**_MLA, **_INDEXED, "pad_token_id": 1, "mlp_layer_types": ["sparse", "sparse"]},
    # Mamba layers with small heads and state, and one attention layer.
    "granitemoehybrid": {
        "layer_types": ["mamba", "attention"],
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_chunk_size": 16,
        "shared_intermediate_size": 64,
    },
    "zaya": {"num_experts_per_tok": 1},  # ZAYA supports top-1 routing only
    # Its attention experts project to head_dim (its kv_channels) * num_key_value_heads: 64 for bitsandbytes.
    "jetmoe": {"head_dim": 32},
    # Its own config names (num_layers, moe_topk, ffn_hidden_size, expert_ffn_hidden_size) and MLA: qk_head_dim is
    # not derived from the nope + rope dims; head_dim is the rope part. 4 identity experts beside the 8 real ones.
    "longcat_flash": {
        **_MLA,
        "num_layers": 2,
        "moe_topk": 2,
        "ffn_hidden_size": 128,
        "expert_ffn_hidden_size": 64,
        "zero_expert_num": 4,
        "qk_head_dim": 32,
        "head_dim": 16,
        "pad_token_id": 1,
    },
    # Encoder-decoder MoE models with their own config names; every layer sparse, so both stacks have experts.
    "switch_transformers": {
        "d_model": 64,
        "d_ff": 128,
        "d_kv": 16,
        "num_heads": 4,
        "num_layers": 2,
        "num_decoder_layers": 2,
        "num_sparse_encoder_layers": 2,
        "num_sparse_decoder_layers": 2,
        "encoder_sparse_step": 1,
        "decoder_sparse_step": 1,
    },
    "nllb-moe": {
        "d_model": 64,
        "encoder_ffn_dim": 128,
        "decoder_ffn_dim": 128,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_sparse_step": 1,
        "decoder_sparse_step": 1,
    },
    # Both layers MoE (the defaults keep the first layers dense).
    "flint": {"mlp_only_layers": []},
    "beam": {"mlp_layer_types": ["sparse", "sparse"], "n_group": 1, "topk_group": 1},
    # One hash-routed MoE layer (the defaults start with three) and one top-k routed, whose router is recorded.
    "deepseek_v4": {"mlp_layer_types": ["hash_moe", "moe"]},
    "deepseek_v2": _MLA,
    "deepseek_v3": {**_MLA, "n_group": 2},
    "glm4_moe": {"first_k_dense_replace": 0, "n_shared_experts": 1, "n_group": 1, "topk_group": 1},
    "glm4_moe_lite": _MLA,
    "dots1": {"first_k_dense_replace": 0, "n_shared_experts": 1, "n_group": 1, "topk_group": 1},
    # Hybrid linear-attention stacks: two layers must include one full-attention layer (the cache needs one).
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"]},
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 1,
        "expert_layer_offset": 0,
    },
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 0},
    # Defaults put pad/bos/eos ids beyond the tiny vocabulary.
    "flex_olmo": {"pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 3},
    "openai_privacy_filter": {"pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 3},
    # Its own config names (d_model, n_heads, ...; experts in ffn_config). transformers 5.24's defaults cannot
    # build the model: the attention reads attn_config.rope_theta, which the default lacks, and clamps by clip_qkv,
    # None by default.
    "dbrx": {
        "d_model": 64,
        "n_heads": 4,
        "n_layers": 2,
        "max_seq_len": 128,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 8, "moe_top_k": 2},
    },
    "kimi_linear": {
        "num_key_value_heads": 4,
        "pad_token_id": 1,
        "bos_token_id": 2,
        "eos_token_id": 3,
        "layer_types": ["linear_attention", "full_attention"],
        "mlp_layer_types": ["sparse", "sparse"],
    },
    "bailing_hybrid": {
        "num_key_value_heads": 4,
        "n_group": 1,
        "topk_group": 1,
        "pad_token_id": 1,
        "bos_token_id": 2,
        "eos_token_id": 3,
        "layer_types": ["linear_attention", "full_attention"],
        "mlp_layer_types": ["sparse", "sparse"],
    },
}


def tiny_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    defaults = AutoConfig.for_model(model_type)
    if _is_composite(defaults) or model_type in _RECIPE_FLAT:
        from ._composite import tiny_composite_config

        return tiny_composite_config(model_type, **overrides)
    settings = {k: v for k, v in _COMMON.items() if hasattr(defaults, k)}
    settings.update(_FAMILY.get(model_type, {}))
    settings.update(overrides)
    settings["attn_implementation"] = "eager"
    return AutoConfig.for_model(model_type, **settings)


# Vision-language families whose image-text model cannot run on text alone in transformers 5.24
# (Llama4ForConditionalGeneration.forward reads `outputs.image_outputs`, which a text-only pass lacks): their
# language model (AutoModelForCausalLM) is what the tests load.
_TEXT_ONLY = frozenset({"llama4"})


def auto_class(model_type: str) -> type:
    """The auto class a family's generative model loads with: a vision-language model's own
    (AutoModelForImageTextToText, or AutoModelForMultimodalLM for omni models), else AutoModelForCausalLM; for a
    model with no language-model head (openai_privacy_filter) AutoModelForTokenClassification, and for an
    encoder-decoder one (switch_transformers) AutoModelForSeq2SeqLM."""
    if model_type in _TEXT_ONLY:
        return AutoModelForCausalLM
    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    if model_type in MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES:
        return AutoModelForMultimodalLM
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if model_type in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
            return AutoModelForTokenClassification
        if model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:  # switch_transformers, nllb-moe
            return AutoModelForSeq2SeqLM
    return AutoModelForCausalLM


def text_logits(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """The logits of `model`'s language model for `input_ids`: its own forward's, or, for an omni model whose
    top-level class only generates (qwen3_omni_moe), its thinker's."""
    thinker = getattr(model, "thinker", None)
    canvas_length = getattr(model.config, "canvas_length", None)
    if canvas_length is not None and "decoder_input_ids" not in kwargs:
        # A block-diffusion model (diffusion_gemma) denoises a canvas it draws at random when none is given: a
        # fixed one makes two models' logits comparable.
        canvas = (
            torch.arange(canvas_length, device=input_ids.device) % model.config.get_text_config().vocab_size
        )
        kwargs["decoder_input_ids"] = canvas.expand(input_ids.shape[0], -1)
    elif getattr(model.config, "is_encoder_decoder", False) and "decoder_input_ids" not in kwargs:
        kwargs["decoder_input_ids"] = input_ids  # switch_transformers, nllb-moe: decode the prompt itself
    return (thinker if thinker is not None else model)(input_ids, **kwargs).logits


# Flat configs whose tiny settings the composite recipe derives (mistral4: MLA head sizes from its nope/rope dims).
_RECIPE_FLAT = frozenset({"mistral4"})


def _is_composite(config: PretrainedConfig) -> bool:
    """A vision-language or omni config: its decoder is a sub-config (text_config, thinker_config)."""
    return any(
        isinstance(getattr(config, name, None), PretrainedConfig)
        for name in ("text_config", "thinker_config")
    )
