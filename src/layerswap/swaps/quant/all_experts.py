"""Who asks LinearExperts to run every expert on every token (all-experts calibration).

A routed MoE feeds an expert only the tokens routed to it. A calibration-based quantizer (GPTQ, AWQ, SmoothQuant)
collects statistics with hooks on each expert's nn.Linear layers, so an expert that the calibration set never
routes to gets none, and is quantized with uninitialised scales: silently wrong weights. While all-experts
calibration is asked for, LinearExperts also runs each expert on the tokens not routed to it and discards the
result, so every expert sees every token exactly once and the layer's output is the routed one, unchanged.

Two things ask for it:
- `layerswap.calibrate_all_experts(model)`, which sets `_layerswap_all_experts_chunk` on the model's LinearExperts;
- llm-compressor's own switch: `oneshot(..., moe_calibrate_all_experts=True)` (its default) sets a flag in
  `llmcompressor.modeling.moe.context` for the duration of calibration, which llm-compressor's own linearised
  experts read. LinearExperts reads the same flag, so oneshot over a model loaded under '<family>-quant'
  calibrates every expert as it would over a stock model. Reading it changes nothing in llm-compressor (there
  is nothing to undo), and needs no import: where llm-compressor is not imported, its pipeline is not running.
"""

from __future__ import annotations

import sys
import warnings

from ...errors import LayerswapWarning

# llm-compressor 0.14's switch: a module with get_calibrate_all_experts_flag() and moe_calibration_context().
LLM_COMPRESSOR_SWITCH_MODULE = "llmcompressor.modeling.moe.context"
LLM_COMPRESSOR_SWITCH_READER = "get_calibrate_all_experts_flag"

# How many unrouted tokens go through an expert at once when a pipeline's switch asks (calibrate_all_experts
# takes its own): bounds the extra activations' memory.
DEFAULT_CHUNK_SIZE = 1024

_warned_unreadable_switch = False


def pipeline_requests_all_experts() -> bool:
    """True while a calibration pipeline that layerswap knows asks for every expert to see every token."""
    switch = sys.modules.get(LLM_COMPRESSOR_SWITCH_MODULE)
    if switch is None:
        return False
    read_flag = getattr(switch, LLM_COMPRESSOR_SWITCH_READER, None)
    if read_flag is None:
        _warn_unreadable_switch()
        return False
    return bool(read_flag())


def _warn_unreadable_switch() -> None:
    global _warned_unreadable_switch
    if _warned_unreadable_switch:
        return
    _warned_unreadable_switch = True
    warnings.warn(
        f"llm-compressor is imported, but its {LLM_COMPRESSOR_SWITCH_MODULE} has no "
        f"{LLM_COMPRESSOR_SWITCH_READER}() (layerswap reads it as llm-compressor 0.14 has it), so layerswap "
        "cannot tell whether oneshot asks to calibrate every expert on every token (moe_calibrate_all_experts). "
        "Experts that the calibration data never routes to would be quantized without statistics. Wrap the "
        "calibration in `with layerswap.calibrate_all_experts(model): oneshot(...)`, and please report the "
        "llm-compressor version.",
        LayerswapWarning,
        stacklevel=3,
    )
