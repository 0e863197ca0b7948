"""bitsandbytes settings for the tiny test models: which non-expert modules stay in full precision where the CPU
kernels reject tiny-config sizes."""

from transformers import BitsAndBytesConfig

from _support.families import MOE_FAMILIES

QUANTIZATION = {
    "nf4": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    "int8": {"load_in_8bit": True},
}

# bitsandbytes' CPU kernels reject some NON-expert projections at tiny-config sizes (MLA low-rank projections,
# mamba and linear-attention mixers: odd widths such as 80 or 7-wide convolutions). Real models have sizes these
# kernels accept. The experts themselves are always quantized: that is what these tests check.
TINY_SIZE_SKIPS = {
    "deepseek_v2": [r".*self_attn"],
    "deepseek_v3": [r".*self_attn"],
    "glm4_moe_lite": [r".*self_attn"],
    "jamba": [r".*mamba"],
    "kimi_linear": [r".*self_attn"],
    "bailing_hybrid": [r".*self_attn"],
    "laguna": [r".*self_attn"],
    "axk1": [r".*self_attn"],
    "deepseek_v32": [r".*self_attn"],
    "glm_moe_dsa": [r".*self_attn"],
    "hy_v4": [r".*self_attn"],
    "granitemoehybrid": [r".*mamba"],
    "deepseek_v4": [r".*self_attn"],
    "mistral4": [r".*self_attn"],
    "longcat_flash": [r".*self_attn"],
    "openai_privacy_filter": [r"score"],  # the token-classification head: 33 labels
    # Routers (8 outputs) of the families that need no bundle, which have no bundle to keep them unquantized.
    "switch_transformers": [r".*router"],
    "nllb-moe": [r".*router"],
    # Every non-expert module: axk2's 16-wide gated norm, lara_mini's linear-attention gates, zaya's CCA projections.
    "axk2": [r"(?!.*\.experts\.).*"],
    "lara_mini": [r"(?!.*\.experts\.).*"],
    "zaya": [r"(?!.*\.experts\.).*"],
}


# Vision-language and omni models: their tiny towers (32 wide) are below what the CPU kernels take; every module
# outside the experts stays in full precision there.
_COMPOSITE = {f.model_type for f in MOE_FAMILIES if f.sub_model_types}


def quantization_config(scheme, model_type="qwen2_moe", **extra):
    skips = [r"(?!.*\.experts\.).*"] if model_type in _COMPOSITE else TINY_SIZE_SKIPS.get(model_type)
    if skips:
        extra["llm_int8_skip_modules"] = [*skips, "lm_head"]
    return BitsAndBytesConfig(**QUANTIZATION[scheme], **extra)
