"""Tiny random models and inputs for tests (configs from layerswap.testing.tiny, shared with the demo)."""

from __future__ import annotations

from typing import Any

import torch

from layerswap.testing.tiny import VOCAB, auto_class, text_logits, tiny_config

__all__ = ["VOCAB", "auto_class", "text_logits", "tiny_config", "tiny_input_ids", "tiny_model"]


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = auto_class(model_type).from_config(tiny_config(model_type, **overrides))
    return model.eval()


def tiny_input_ids(batch: int = 2, length: int = 7, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=generator)
