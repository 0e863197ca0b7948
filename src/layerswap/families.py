"""The model families layerswap serves: one row per transformers model type, naming the classes it replaces.

Adding a family is one row here; each purpose under `swaps/` builds its bundle from the row (or none, for a family
it does not serve).
"""

from __future__ import annotations

from .bundle import Family

# MoE families: every family whose Experts class has the stock v5 layout (`@use_experts_implementation` with its defaults:
# gate_up_proj [E, 2I, H] gate-first, down_proj [E, H, I], no bias). tests/test_catalog.py checks each row
# against the installed transformers, and that no such class is left out without a reason.
FAMILIES: tuple[Family, ...] = (
    Family("qwen2_moe", "Qwen2MoeExperts", router="Qwen2MoeTopKRouter", attention="Qwen2MoeAttention"),
    Family("qwen3_moe", "Qwen3MoeExperts", router="Qwen3MoeTopKRouter", attention="Qwen3MoeAttention"),
    Family("qwen3_next", "Qwen3NextExperts", router="Qwen3NextTopKRouter", attention="Qwen3NextAttention"),
    Family("mixtral", "MixtralExperts", router="MixtralTopKRouter", attention="MixtralAttention"),
    Family("minimax", "MiniMaxExperts", router="MiniMaxTopKRouter", attention="MiniMaxAttention"),
    Family("minimax_m2", "MiniMaxM2Experts", router="MiniMaxM2TopKRouter", attention="MiniMaxM2Attention"),
    Family("olmoe", "OlmoeExperts", router="OlmoeTopKRouter", attention="OlmoeAttention"),
    Family("flex_olmo", "FlexOlmoExperts", router="FlexOlmoTopKRouter", attention="FlexOlmoAttention"),
    Family("deepseek_v2", "DeepseekV2Experts", router="DeepseekV2TopkRouter"),
    Family("deepseek_v3", "DeepseekV3Experts", router="DeepseekV3TopkRouter"),
    Family("glm4_moe", "Glm4MoeExperts", router="Glm4MoeTopkRouter", attention="Glm4MoeAttention"),
    Family("glm4_moe_lite", "Glm4MoeLiteExperts", router="Glm4MoeLiteTopkRouter"),
    Family("dots1", "Dots1Experts", router="Dots1TopkRouter", attention="Dots1Attention"),
    Family(
        "ernie4_5_moe",
        "Ernie4_5_MoeExperts",
        router="Ernie4_5_MoeTopKRouter",
        attention="Ernie4_5_MoeAttention",
    ),
    Family(
        "hunyuan_v1_moe", "HunYuanMoEV1Experts", router="HunYuanMoEV1Gate", attention="HunYuanMoEV1Attention"
    ),
    Family("granitemoe", "GraniteMoeExperts", router="GraniteMoeTopKRouter", attention="GraniteMoeAttention"),
    Family(
        "granitemoeshared",
        "GraniteMoeSharedExperts",
        router="GraniteMoeSharedTopKRouter",
        attention="GraniteMoeSharedAttention",
    ),
    Family("phimoe", "PhimoeExperts", router="PhimoeTopKRouter", attention="PhimoeAttention"),
    Family("jamba", "JambaExperts", router="JambaTopKRouter", attention="JambaAttention"),
    Family("exaone_moe", "ExaoneMoeExperts", router="ExaoneMoeTopkRouter", attention="ExaoneMoeAttention"),
    Family("afmoe", "AfmoeExperts", router="AfmoeTokenChoiceRouter", attention="AfmoeAttention"),
    Family(
        "cohere2_moe", "Cohere2MoeExperts", router="Cohere2MoeTopKRouter", attention="Cohere2MoeAttention"
    ),
    Family("solar_open", "SolarOpenExperts", router="SolarOpenTopkRouter", attention="SolarOpenAttention"),
    Family("lfm2_moe", "Lfm2MoeExperts", router="Lfm2MoeTopKRouter", attention="Lfm2MoeAttention"),
    Family("mellum", "MellumExperts", router="MellumTopKRouter", attention="MellumAttention"),
    Family(
        "mimo_v2_flash",
        "MiMoV2FlashExperts",
        router="MiMoV2FlashTopkRouter",
        attention="MiMoV2FlashAttention",
    ),
    Family("kimi_linear", "KimiLinearExperts", router="KimiLinearTopkRouter"),
    Family("bailing_hybrid", "BailingHybridExperts", router="BailingHybridTopkRouter"),
    Family("laguna", "LagunaExperts", router="LagunaTopKRouter", attention="LagunaAttention"),
    Family("granitemoe_swa", "GraniteMoeSWAExperts"),
    Family("hy_v3", "HYV3Experts"),
    Family("kolibri1", "Kolibri1Experts"),
    # Dense families: attention swaps only.
    Family("llama", attention="LlamaAttention"),
    Family("mistral", attention="MistralAttention"),
    Family("qwen2", attention="Qwen2Attention"),
    Family("qwen3", attention="Qwen3Attention"),
)
