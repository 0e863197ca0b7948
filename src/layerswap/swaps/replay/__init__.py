"""'<model_type>-replay': the family's MoE router, able to replay recorded expert choices (`layerswap.replay_routing`,
e.g. vLLM rollouts via `routing_from_vllm`) with weights from the live router, so gradients reach it; the base
model gains `output_selected_experts=True`."""

from __future__ import annotations

from collections.abc import Callable

from ..._hf.recorders import add_router_output_recorder
from ...bundle import Bundle, BundleOptions, Family, Installer, Patch
from .modules import SCORERS, ReplayableRouter, replayable_router_adapter, scorer_for

__all__ = [
    "SCORERS",
    "SELECTED_EXPERTS",
    "ReplayableRouter",
    "build",
    "replayable_router_adapter",
    "scorer_for",
]

# Capture key: `model.model(..., output_selected_experts=True).selected_experts`, one [T, K] per MoE layer.
SELECTED_EXPERTS = "selected_experts"


def _selected_experts_recorder(family: Family) -> Installer:
    """Adds `selected_experts` (router output 2) to the family's recorded outputs, beside its `router_logits`."""

    def install(options: BundleOptions) -> Callable[[], None]:
        return add_router_output_recorder(family.modeling_module, family.router, SELECTED_EXPERTS)

    return install


def build(family: Family) -> Bundle | None:
    """`<model_type>-replay` for every MoE family whose router returns (logits, scores, indices)."""
    scorer = scorer_for(family.router)
    if scorer is None:
        return None
    return Bundle.for_family(
        family,
        "replay",
        (
            f"{family.router} that can replay recorded expert choices (layerswap.replay_routing, e.g. vLLM "
            "rollouts via routing_from_vllm) with weights from the live router, so gradients reach it; adds "
            "output_selected_experts=True to the base model. Composes with the '-quant' bundle."
        ),
        patches=(Patch(family.modeling_module, family.router, replayable_router_adapter(scorer)),),
        installers=(_selected_experts_recorder(family),),
        needs=("replay",),
    )
