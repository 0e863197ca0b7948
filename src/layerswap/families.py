"""The model families layerswap serves: one row per transformers model type, naming the classes it replaces.

Two sources, in this order:
- TYPED: rows written by hand, for what cannot be read from transformers (the router whose math the '-replay'
  scorers mirror, the attention class '-fused_qkv' is tested on, a modeling module elsewhere);
- derived rows: every other MoE family of the installed transformers whose experts declare the stock fused layout
  (`_hf.discovery`), so a release that adds one is served with no code change.
Families whose experts are nn.Linear already are in ALREADY_LINEAR (they need no bundle); every other MoE family of
the installed transformers is in UNCOVERED, with the reason. Each purpose under
`swaps/` builds its bundle from a row (or none, for a family it does not serve).
"""

from __future__ import annotations

from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
)

from ._hf.conversions import has_own_conversions
from ._hf.discovery import DiscoveredFamily, ExpertsDeclaration, discover
from .bundle import ExpertsFlags, Family, FusedTensor
from .swaps.replay.modules import scorer_for

# MoE families: every family whose Experts class has the stock v5 layout (`@use_experts_implementation` with its defaults:
# gate_up_proj [E, 2I, H] gate-first, down_proj [E, H, I], no bias). tests/test_catalog.py checks each row
# against the installed transformers, and that no such class is left out without a reason.
TYPED: tuple[Family, ...] = (
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
    # An experts class of its own: every expert's gate (w1), up (v1) and transposed down (w2) stacked as [E * I, H].
    # No router named: DbrxRouter has no replay scorer yet, so no '-replay' bundle (listed by `layerswap list`).
    Family(
        "dbrx",
        "DbrxExperts",
        tensors=(
            FusedTensor("mlp.w1", ("gate",), flat=True),
            FusedTensor("mlp.v1", ("up",), flat=True),
            FusedTensor("mlp.w2", ("down",), flat=True, transposed=True),
        ),
    ),
    # Each projection of every expert stacked in a module of its own (`input_linear.weight [E, 2I, H]`, gate and up
    # joined; `output_linear.weight [E, H, I]`), in the MoE MLP and in the mixture-of-attention (each attention
    # expert's query and output projections) alike; each becomes one nn.Linear per expert.
    Family(
        "jetmoe",
        "JetMoeParallelExperts",
        router="JetMoeTopKGating",
        tensors=(
            FusedTensor("input_linear.weight", ("gate", "up")),
            FusedTensor("output_linear.weight", ("down",)),
        ),
    ),
    # Identity (zero-compute) experts after the real ones: gate_up_proj stacks all of them, down_proj the real ones
    # (the stock parameters, listed since the class declares no layout; no fused kernel computes identity experts).
    Family(
        "longcat_flash",
        "LongcatFlashExperts",
        router="LongcatFlashTopkRouter",
        tensors=(FusedTensor("gate_up_proj", ("gate", "up")), FusedTensor("down_proj", ("down",))),
    ),
    # Dense families: attention swaps only.
    Family("llama", attention="LlamaAttention"),
    Family("mistral", attention="MistralAttention"),
    Family("qwen2", attention="Qwen2Attention"),
    Family("qwen3", attention="Qwen3Attention"),
)


# Why a MoE family that no row covers is not served, where a fact says more than the derived reason.
_REASONS: dict[str, str] = {
    # Derivable, but the walk (tests/swaps/quant/test_conversion.py) fails on them today, as measured on 5.24:
    "ernie4_5_vl_moe": "derived, but each layer holds text and vision experts of one class (text_moe, "
    "vision_moe), which the conversions do not tell apart: loading fails",
}


# MoE families whose experts are already nn.Linear modules, one small MLP per expert: bitsandbytes, torchao, quanto and
# HQQ quantize them with no bundle, and their stock checkpoints are per-expert already. What each expert is;
# tests/quantizers/test_already_linear.py checks the claim on the installed transformers (nf4 quantizes every
# expert Linear; the checkpoint saves back bitwise).
ALREADY_LINEAR: dict[str, str] = {
    "switch_transformers": "SwitchTransformersDenseActDense (wi, wo) per expert",
    "nllb-moe": "NllbMoeDenseActDense (fc1, fc2) per expert",
}
# What a user of a quantizer must still know about such a family, as measured on the installed transformers.
_ALREADY_LINEAR_CAVEATS: dict[str, str] = {
    "switch_transformers": "Under bitsandbytes 4-bit keep `wo` unquantized (llm_int8_skip_modules=['wo', ...]): "
    "stock transformers casts its input to wo's weight dtype, uint8 once packed, and computes garbage; 8-bit is fine.",
}


def already_linear_reason(model_type: str) -> str:
    caveat = _ALREADY_LINEAR_CAVEATS.get(model_type)
    return (
        f"experts are already nn.Linear ({ALREADY_LINEAR[model_type]}): every quantizer sees them, no bundle "
        f"needed.{' ' + caveat if caveat else ''}"
    )


# Where a family's model with a head is registered: a language model, a vision-language / omni one whose text
# model holds the experts, or (openai_privacy_filter) a token classifier. `layerswap.testing.auto_class` loads
# each with its own auto class.
_GENERATIVE = (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
)


# The layout of Experts classes that declare none (no `@use_experts_implementation`), read from their forward.
_UNDECLARED_FLAGS: dict[str, ExpertsFlags] = {
    # gate_up_proj [E, H, 2I] and down_proj [E, I, H], multiplied as `x @ w`; gate columns first.
    "Llama4TextExperts": ExpertsFlags(is_transposed=True),
    # The stock layout, with its own clamped SwiGLU (`_apply_gate`, the clamp limit per layer).
    "Step3p7Experts": ExpertsFlags(),
}


def _flags(declaration: ExpertsDeclaration) -> ExpertsFlags | None:
    return declaration.flags if declaration.decorated else _UNDECLARED_FLAGS.get(declaration.name)


def _uncovered_reason(found: DiscoveredFamily) -> str | None:
    """Why the standard swaps cannot serve `found` (None: a derived row serves it)."""
    if _primary(found) in _REASONS:
        return _REASONS[_primary(found)]
    if any(_flags(e) is None for e in found.experts) or len({_flags(e) for e in found.experts}) > 1:
        declared = ", ".join(
            f"{e.name}({', '.join(f'{k}={v}' for k, v in e.layout)})"
            if e.decorated
            else f"{e.name} (undecorated)"
            for e in found.experts
            if not e.is_stock_layout
        )
        return f"experts in a layout no adapter has: {declared}"
    if not any(_primary(found) in mapping for mapping in _GENERATIVE):
        return (
            "no class with a head in AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForMultimodalLM or "
            "AutoModelForTokenClassification (the model is built inside another one)"
        )
    return None


def _primary(found: DiscoveredFamily) -> str:
    """The model type a family's bundles are named by: its module's own, else the first with a generative class
    (inkling's module registers inkling_audio, inkling_mm_model, inkling_text and inkling_vision)."""
    generative = [t for t in found.model_types if any(t in mapping for mapping in _GENERATIVE)]
    return found.model_type if found.model_type in generative or not generative else generative[0]


def _router(found: DiscoveredFamily, experts: str) -> str | None:
    """The family's top-k router: the router class named like its experts class."""
    prefix = experts.removesuffix("Experts")
    named = [r for r in found.routers if r.startswith(prefix) and "Router" in r]
    top_k = [r for r in named if "topk" in r.lower()]  # deepseek_v4 has a hash router beside its top-k one
    return named[0] if len(named) == 1 else top_k[0] if len(top_k) == 1 else None


def _derive() -> tuple[tuple[Family, ...], dict[str, str]]:
    typed = {f.model_type for f in TYPED} | {f.experts for f in TYPED if f.experts}
    rows: list[Family] = []
    uncovered: dict[str, str] = {}
    for found in discover():
        if found.model_type in typed or any(e.name in typed for e in found.experts):
            continue
        if _primary(found) in ALREADY_LINEAR:
            continue
        reason = _uncovered_reason(found)
        if reason is not None:
            uncovered[_primary(found)] = reason
            continue
        experts, *more = found.experts
        primary = _primary(found)
        rows.append(
            Family(
                primary,
                experts.name,
                router=_router(found, experts.name),
                module=found.modeling_module,
                own_gate=any(e.own_gate for e in found.experts),
                more_experts=tuple(e.name for e in more),
                flags=_flags(experts),
                sub_model_types=tuple(t for t in found.model_types if t != primary),
                conversion_classes=tuple(c for c in found.classes if has_own_conversions(c)),
            )
        )
    return tuple(rows), uncovered


DERIVED, UNCOVERED = _derive()
# Every family layerswap serves: the typed rows, then the derived ones.
FAMILIES: tuple[Family, ...] = TYPED + DERIVED


def families_without_replay() -> dict[str, str | None]:
    """MoE families served without a '-replay' bundle, with their router class (None: none found): no scorer in
    `swaps/replay` mirrors how it weights the experts it picks yet."""
    return {f.model_type: f.router for f in FAMILIES if f.experts and scorer_for(f.router) is None}
