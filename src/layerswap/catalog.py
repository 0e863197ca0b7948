"""The bundles, declared as data from one family table: adding a family is one row, not a new file."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._bundle import Bundle, Patch
from .adapters.experts import linear_experts_adapter
from .conversions.experts import linear_experts_conversions

# Routers and 1-wide gates (e.g. qwen2_moe's shared_expert_gate, an nn.Linear(H, 1)) stay in full precision by
# default, as llm-compressor does: they are tiny, routing is sensitive to them, and bitsandbytes' CPU kernels
# reject 1-wide outputs. Suffixes of module names; override with enable_bundle(..., keep_unquantized=(...)).
DEFAULT_KEEP_UNQUANTIZED = ("gate", "router", "shared_expert_gate")


@dataclass(frozen=True)
class Family:
    """One transformers model type and the names of the classes layerswap replaces in it."""

    model_type: str
    experts: str
    module: str | None = None  # defaults to transformers.models.<model_type>.modeling_<model_type>
    keep_unquantized: tuple[str, ...] = DEFAULT_KEEP_UNQUANTIZED

    @property
    def modeling_module(self) -> str:
        return self.module or f"transformers.models.{self.model_type}.modeling_{self.model_type}"


# Every family whose Experts class has the stock v5 layout (`@use_experts_implementation` with its defaults:
# gate_up_proj [E, 2I, H] gate-first, down_proj [E, H, I], no bias). tests/test_catalog.py checks each row
# against the installed transformers, and that no such class is left out without a reason.
FAMILIES: tuple[Family, ...] = (
    Family("qwen2_moe", "Qwen2MoeExperts"),
    Family("qwen3_moe", "Qwen3MoeExperts"),
    Family("qwen3_next", "Qwen3NextExperts"),
    Family("mixtral", "MixtralExperts"),
    Family("minimax", "MiniMaxExperts"),
    Family("minimax_m2", "MiniMaxM2Experts"),
    Family("olmoe", "OlmoeExperts"),
    Family("flex_olmo", "FlexOlmoExperts"),
    Family("deepseek_v2", "DeepseekV2Experts"),
    Family("deepseek_v3", "DeepseekV3Experts"),
    Family("glm4_moe", "Glm4MoeExperts"),
    Family("glm4_moe_lite", "Glm4MoeLiteExperts"),
    Family("dots1", "Dots1Experts"),
    Family("ernie4_5_moe", "Ernie4_5_MoeExperts"),
    Family("hunyuan_v1_moe", "HunYuanMoEV1Experts"),
    Family("granitemoe", "GraniteMoeExperts"),
    Family("granitemoeshared", "GraniteMoeSharedExperts"),
    Family("phimoe", "PhimoeExperts"),
    Family("jamba", "JambaExperts"),
    Family("exaone_moe", "ExaoneMoeExperts"),
    Family("afmoe", "AfmoeExperts"),
    Family("cohere2_moe", "Cohere2MoeExperts"),
    Family("solar_open", "SolarOpenExperts"),
    Family("lfm2_moe", "Lfm2MoeExperts"),
    Family("mellum", "MellumExperts"),
    Family("mimo_v2_flash", "MiMoV2FlashExperts"),
    Family("mistral4", "Mistral4Experts"),
    Family("kimi_linear", "KimiLinearExperts"),
    Family("bailing_hybrid", "BailingHybridExperts"),
    Family("laguna", "LagunaExperts"),
)


def _quant_bundle(family: Family) -> Bundle:
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
