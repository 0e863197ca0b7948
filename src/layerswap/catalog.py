"""The bundles, declared as data from one family table: adding a family is one row, not a new file."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._bundle import Bundle, Patch
from ._fast_bundles import fast_bundle
from ._fused_qkv_bundles import fused_qkv_bundle
from .adapters.experts import linear_experts_adapter
from .conversions.experts import linear_experts_conversions
from .routing import _replay_bundle

# Routers and 1-wide gates (e.g. qwen2_moe's shared_expert_gate, an nn.Linear(H, 1)) stay in full precision by
# default, as llm-compressor does: they are tiny, routing is sensitive to them, and bitsandbytes' CPU kernels
# reject 1-wide outputs. Suffixes of module names; override with enable_bundle(..., keep_unquantized=(...)).
DEFAULT_KEEP_UNQUANTIZED = ("gate", "router", "shared_expert_gate")


@dataclass(frozen=True)
class Family:
    """One transformers model type and the names of the classes layerswap replaces in it."""

    model_type: str
    experts: str | None = None  # group-A Experts class; None for dense families
    router: str | None = None  # MoE router class
    attention: str | None = None  # attention class with separate q_proj / k_proj / v_proj
    module: str | None = None  # defaults to transformers.models.<model_type>.modeling_<model_type>
    keep_unquantized: tuple[str, ...] = DEFAULT_KEEP_UNQUANTIZED

    @property
    def modeling_module(self) -> str:
        return self.module or f"transformers.models.{self.model_type}.modeling_{self.model_type}"


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


def _quant_bundle(family: Family) -> Bundle | None:
    if family.experts is None:
        return None
    return Bundle(
        name=f"{family.model_type}-quant",
        purpose="quant",
        model_types=(family.model_type,),
        description=(
            f"{family.experts} as an nn.ModuleList of plain nn.Linear experts, so bitsandbytes, GPTQ/AWQ, "
            "torchao, quanto and HQQ quantize every expert. Loads per-expert and fused checkpoints; saves the "
            "stock layout."
        ),
        patches=(Patch(family.modeling_module, family.experts, linear_experts_adapter(family.model_type)),),
        conversions={family.model_type: linear_experts_conversions},
        keep_unquantized=family.keep_unquantized,
    )


# One builder per purpose; a builder returns None for a family it does not serve.
BUNDLE_BUILDERS: dict[str, Callable[[Family], Bundle | None]] = {
    "quant": _quant_bundle,
    "fused_qkv": fused_qkv_bundle,
    "fast": fast_bundle,
    "replay": _replay_bundle,
}


def _build_catalog() -> dict[str, Bundle]:
    catalog: dict[str, Bundle] = {}
    for family in FAMILIES:
        for build in BUNDLE_BUILDERS.values():
            bundle = build(family)
            if bundle is not None:
                catalog[bundle.name] = bundle
    return dict(sorted(catalog.items()))


CATALOG: dict[str, Bundle] = _build_catalog()
