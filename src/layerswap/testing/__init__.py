"""Helpers for tests of code that uses layerswap (layerswap's own tests and benchmarks use them too): tiny
random configs of every catalog family, and a fresh-process load probe (`layerswap.testing.load_probe`)."""

from __future__ import annotations

from .tiny import VOCAB, auto_class, text_logits, tiny_config

__all__ = ["VOCAB", "auto_class", "text_logits", "tiny_config"]
