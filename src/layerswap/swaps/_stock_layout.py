"""How a family's stock conversions store its experts in checkpoints: per expert (`mlp.experts.3.gate_proj.weight`,
merged into the fused 3D tensors on load) or fused, and the per-expert projection names. Shared by the purposes
that re-lay experts out or check their merges."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from transformers.core_model_loading import MergeModulelist, WeightConverter, WeightTransform

from .._hf.conversions import source_patterns, stock_conversions, target_patterns


@dataclass(frozen=True)
class ExpertNames:
    """Attribute names of one expert's projections, as the family's per-expert checkpoints name them
    (qwen2_moe: gate_proj/up_proj/down_proj; mixtral: w1/w3/w2), so checkpoints load without renaming."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


_PER_EXPERT_SOURCE = re.compile(r"^(?P<prefix>.*experts)\.\*\.(?P<name>\w+)\.weight$")


@dataclass(frozen=True)
class ExpertsLayout:
    """How a family's stock conversions store experts in checkpoints."""

    names: ExpertNames
    experts_prefix: str  # pattern of the experts module path as the converters see it, e.g. "mlp.experts"
    per_expert_checkpoints: bool  # stock merges per-expert keys into 3D tensors on load


def is_per_expert_merge(transform: WeightTransform) -> bool:
    return (
        isinstance(transform, WeightConverter)
        and bool(transform.operations)
        and isinstance(transform.operations[0], MergeModulelist)
        and all(_PER_EXPERT_SOURCE.match(s) for s in source_patterns(transform))
        and len(target_patterns(transform)) == 1
        and target_patterns(transform)[0].endswith(
            ("experts.gate_up_proj", "experts.up_proj", "experts.down_proj")
        )
    )


def experts_layout(stock: list[WeightTransform] | None) -> ExpertsLayout:
    merges = [t for t in stock or [] if is_per_expert_merge(t)]
    if not merges:
        return ExpertsLayout(ExpertNames(), "experts", per_expert_checkpoints=False)
    names: dict[str, str] = {}
    prefix = "experts"
    for merge in merges:
        matches = [_PER_EXPERT_SOURCE.match(s) for s in source_patterns(merge)]
        # Stock patterns are regexes (kimi_linear writes `\\.experts`); targets are literal key text.
        prefix = matches[0]["prefix"].replace("\\.", ".")
        if target_patterns(merge)[0].endswith("gate_up_proj"):
            names["gate"], names["up"] = (m["name"] for m in matches)
        elif target_patterns(merge)[0].endswith("up_proj"):  # gate-less experts (nemotron_h)
            names["up"] = matches[0]["name"]
        else:
            names["down"] = matches[0]["name"]
    return ExpertsLayout(ExpertNames(**names), prefix, per_expert_checkpoints=True)


@functools.cache
def stock_experts_layout(*model_types: str) -> ExpertsLayout:
    """The layout of the first of `model_types` (a family's, its sub-configs' after it) whose stock conversions
    merge per-expert checkpoints; the fused one when none does."""
    layouts = [experts_layout(stock_conversions(model_type)) for model_type in model_types]
    return next((layout for layout in layouts if layout.per_expert_checkpoints), layouts[0])
