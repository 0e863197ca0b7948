"""How the suite compares tensors.

Copied tensors (weights, state dicts, saved files, routing indices) must be bitwise equal: use `torch.equal`.
Computed tensors (logits, outputs, gradients) may differ in the last bits between two loads of the same
weights, even on one CPU (oneDNN and the vectorised kernels pick code paths by alignment and size), so they are
compared with `assert_computed_close`: a tolerance per dtype, relative to the expected tensor's scale. Only
when both sides provably run the same kernels on the same tensors in the same process (one model, called
twice) may a computed tensor be compared bitwise.
"""

from __future__ import annotations

import torch

# Relative tolerance per dtype: on elements, and on the whole tensor's scale (max |expected|).
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10, torch.float16: 1e-3, torch.bfloat16: 2e-2}


def assert_computed_close(
    actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None
) -> None:
    """`actual` equals `expected` within the tolerance of `dtype` (default: expected's dtype)."""
    tolerance = TOLERANCE[dtype or expected.dtype]
    scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual, expected, rtol=tolerance, atol=tolerance * max(scale, 1e-6), check_dtype=dtype is None
    )
