"""Tiny random models and inputs for tests (configs from layerswap.testing.tiny, shared with the demo)."""

from __future__ import annotations

from typing import Any

import torch

from layerswap.testing.tiny import VOCAB, auto_class, text_logits, tiny_config

__all__ = ["VOCAB", "auto_class", "text_logits", "tiny_config", "tiny_input_ids", "tiny_model"]


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = auto_class(model_type).from_config(tiny_config(model_type, **overrides))
    _initialise_left_empty(model)
    return model.eval()


@torch.no_grad()
def _initialise_left_empty(model: torch.nn.Module) -> None:
    """Give seeded values to parameters that transformers' _init_weights left as torch.empty memory (5.15 has no
    branch for Qwen3OmniMoeTalkerTextExperts: its tensors hold denormals, infs or NaNs that change run to run, so a
    quantized round trip compared NaN with NaN). Such memory is told apart by values no init writes."""
    for parameter in model.parameters():
        if not parameter.is_floating_point() or parameter.numel() == 0:
            continue
        largest = parameter.abs().max()
        if not torch.isfinite(largest) or largest > 1e4 or 0 < largest < 1e-30:
            parameter.normal_(0.0, 0.02)


def tiny_input_ids(batch: int = 2, length: int = 7, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=generator)
