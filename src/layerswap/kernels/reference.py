"""Fused MoE experts in plain PyTorch: the CPU fast path and the oracle the Triton kernels are tested against.

Math (transformers v5 "group A" experts, no bias):
    out[t] = sum_k w[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t)),   e = top_k_index[t, k]
with `gate_up_proj [E, 2I, H]` (gate rows first), `down_proj [E, H, I]`.

Why it is faster than the stock backends on CPU. Each expert sees only `m` rows (m ~ T*K/E: 1-3 at decode
and small batches, 8-35 for a prefill of 128-512 tokens), so every per-expert GEMM is skinny, and how fast a
skinny GEMM streams its weight depends on its shape, not just its size. Measured on a 2-core Sapphire Rapids
(benchmarks/bench_fused_moe.py and the sweeps quoted in the comments below), MKL's `x @ W.T` with
4 <= m <= 64 fp32 rows streams the weight at only 6-15 GB/s against ~30 GB/s for a GEMV, and oneDNN's bf16
`x @ W.T` at 12-20 GB/s. So the work is reshaped per expert, from its row count:
- m == 1: a GEMV (`torch.mv`);
- fp32 with m <= 3: `x @ W.T`, where MKL's small-m kernel is still at bandwidth;
- otherwise weight-major, `(W @ x.T).T`: the weight becomes the tall M side that the library streams once
  and the few tokens the narrow N side, 17-20 GB/s fp32 (oneDNN) and 22-29 GB/s bf16, 1.3-1.9x per expert.
Routing is sorted once; each active expert works on one contiguous slice of the gathered rows (one
projection at a time, into one buffer, with a single activation over all pairs in between), and the
weighted results are scattered back in fp32.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from itertools import accumulate

import torch
import torch.nn.functional as F

Activation = str | Callable[[torch.Tensor], torch.Tensor]

# Names follow transformers' ACT2FN keys, so an experts module's activation maps onto them one to one.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

# Below this many rows (2-3; one row is a GEMV) an fp32 expert runs as `x @ W.T`, where MKL's small-m kernel
# is at bandwidth; from it on, weight-major is 1.2-1.9x faster (crossover 3 -> 4 for H=2048, I in {768, 1408}).
_FP32_WEIGHT_MAJOR_MIN_ROWS = 4

# torch >= 2.9 has a CPU grouped GEMM (what stock grouped_mm calls): one C++ loop over the experts.
_TORCH_VERSION = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_CPU_GROUPED_MM = _GROUPED_MM is not None and _TORCH_VERSION >= (2, 9)

_HAS_MKLDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# oneDNN's call costs ~35 us of fixed overhead (1 thread), against ~3 us for MKL on a tiny matrix: only worth it
# for weights of 1M elements or more (a 1408 x 2048 projection takes ~2 ms).
_MKLDNN_MIN_WEIGHT_NUMEL = 1 << 20


def resolve_activation(activation: Activation) -> Callable[[torch.Tensor], torch.Tensor]:
    """The elementwise function for an activation name (an ACT2FN key) or a callable, which is returned as is."""
    if callable(activation):
        return activation
    try:
        return ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(
            f"unknown activation {activation!r}: expected one of {sorted(ACTIVATIONS)} or a callable"
        ) from None


def _use_weight_major(rows: int, dtype: torch.dtype) -> bool:
    if dtype == torch.float32:
        return rows >= _FP32_WEIGHT_MAJOR_MIN_ROWS
    # Reduced precision goes through oneDNN, whose weight-major kernel wins at every row count we measured.
    return True


def _weight_major_mm(weight: torch.Tensor, inputs: torch.Tensor, differentiable: bool) -> torch.Tensor:
    """`weight @ inputs.T` ([N, K] x [m, K] -> [N, m]) with the fastest CPU engine for that orientation."""
    if (
        _HAS_MKLDNN
        and not differentiable
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.numel() >= _MKLDNN_MIN_WEIGHT_NUMEL
    ):
        # MKL's sgemm for a tall weight times a few columns streams at ~14 GB/s; oneDNN's at ~19 GB/s.
        # Its `linear(input=weight, weight=inputs)` is exactly weight @ inputs.T. It has no autograd formula,
        # hence the `differentiable` guard.
        return torch.ops.mkldnn._linear_pointwise(weight, inputs.contiguous(), None, "none", [], "")
    return torch.mm(weight, inputs.t())


def _rows_times_weight(
    rows: torch.Tensor, weight: torch.Tensor, differentiable: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`rows @ weight.T` ([m, K] x [N, K] -> [m, N]) for one expert, in the fastest form for its row count.
    Writes into `out` when given (saves a copy; `out=` variants have no backward, so only without autograd)."""
    if rows.shape[0] == 1:
        # One row (every expert at decode): a plain GEMV. For bf16 it streams ~20% faster than either GEMM
        # orientation (oneDNN treats a 1-column GEMM as a GEMM); for fp32 it ties with MKL's x @ W.T.
        if out is None:
            return torch.mv(weight, rows[0])[None]
        torch.mv(weight, rows[0], out=out[0])
        return out
    if _use_weight_major(rows.shape[0], rows.dtype):
        result = _weight_major_mm(weight, rows, differentiable).t()  # a transposed [N, m] view
        # copy_ of a transposed view into a contiguous slice takes PyTorch's blocked-transpose path.
        return result if out is None else out.copy_(result)
    return torch.mm(rows, weight.t()) if out is None else torch.mm(rows, weight.t(), out=out)


def _gemv_regime_grouped(
    rows: torch.Tensor, weights: torch.Tensor, sizes: list[int], experts: list[int], out: torch.Tensor | None
) -> torch.Tensor:
    """Torch's grouped GEMM (a C++ loop, what stock grouped_mm runs) over `experts` only.

    For experts with 1-3 fp32 rows (all of them at decode, most at T=16): MKL's x @ W.T is at bandwidth
    there, so no other shape is faster, and the only cost left is one Python dispatch per expert, 2-8% of the
    layer with 80 active experts. With `out=None` every active expert is in `experts`: no gather needed.
    """
    num_experts = weights.shape[0]
    weights_t = weights.transpose(1, 2)  # a view, as stock grouped_mm passes it
    if out is None:
        offsets = torch.tensor(list(accumulate(sizes[:num_experts])), dtype=torch.int32)
        out = _GROUPED_MM(rows, weights_t, offs=offsets)
        if sizes[-1]:
            out[rows.shape[0] - sizes[-1] :].zero_()  # rows past the last offset are left unwritten
        return out
    chosen = set(experts)
    starts = list(accumulate(sizes, initial=0))
    index = torch.tensor([r for e in experts for r in range(starts[e], starts[e + 1])])
    offsets = torch.tensor(list(accumulate(sizes[e] if e in chosen else 0 for e in range(num_experts))),
                           dtype=torch.int32)
    return out.index_copy_(0, index, _GROUPED_MM(rows[index], weights_t, offs=offsets))


def _grouped_project(
    rows: torch.Tensor, weights: torch.Tensor, sizes: list[int], differentiable: bool
) -> torch.Tensor:
    """[S, K] rows grouped by expert (`sizes[e]` rows for expert e, then a tail of sentinel pairs) times
    each expert's `weights[e].T`: [S, N], zero on the tail."""
    num_experts, num_out = weights.shape[0], weights.shape[1]
    if differentiable:
        pieces = [
            _rows_times_weight(x, weights[expert], True)
            for expert, x in enumerate(rows.split(sizes)[:num_experts])
            if x.shape[0]
        ]
        return torch.cat([*pieces, rows.new_zeros(sizes[-1], num_out)])

    active = [e for e in range(num_experts) if sizes[e]]
    gemv_regime = []
    if _CPU_GROUPED_MM and rows.dtype == torch.float32 and rows.device.type == "cpu":
        gemv_regime = [e for e in active if sizes[e] < _FP32_WEIGHT_MAJOR_MIN_ROWS]
        if len(gemv_regime) == len(active):
            return _gemv_regime_grouped(rows, weights, sizes, gemv_regime, None)
    out = rows.new_empty(rows.shape[0], num_out)
    if gemv_regime:
        _gemv_regime_grouped(rows, weights, sizes, gemv_regime, out)
    slices, out_slices = rows.split(sizes), out.split(sizes)  # one dispatch each for every expert's slice
    for expert in sorted(set(active) - set(gemv_regime)):
        _rows_times_weight(slices[expert], weights[expert], False, out=out_slices[expert])
    if sizes[-1]:
        out_slices[-1].zero_()
    return out


def fused_moe_reference(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    activation: Activation = "silu",
) -> torch.Tensor:
    """MoE experts forward in plain PyTorch.

    Args:
        hidden_states: `[T, H]`.
        gate_up_proj: `[E, 2I, H]`, gate rows first, then up rows.
        down_proj: `[E, H, I]`.
        top_k_index: `[T, K]` integer expert ids. Ids >= E (expert-parallel sentinels) contribute nothing.
        top_k_weights: `[T, K]` routing weights, multiplied in fp32.
        activation: an ACT2FN name ("silu", "gelu", "gelu_pytorch_tanh", "relu") or an elementwise callable.

    Returns:
        `[T, H]` in `hidden_states.dtype`. Differentiable when autograd needs it.
    """
    act = resolve_activation(activation)
    num_tokens, hidden_size = hidden_states.shape
    num_experts = gate_up_proj.shape[0]
    top_k = top_k_index.shape[-1]
    differentiable = torch.is_grad_enabled() and any(
        t.requires_grad for t in (hidden_states, gate_up_proj, down_proj, top_k_weights)
    )

    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)
    token_of_pair = order // top_k
    rows_per_expert = torch.bincount(expert_ids, minlength=num_experts).tolist()  # host sync: fine on CPU
    # One gather; every expert then reads a contiguous slice. Computed in the weights' dtype, like the stock
    # backends (autocast can hand fp32 activations to bf16 weights).
    sorted_rows = hidden_states[token_of_pair].to(gate_up_proj.dtype)

    sizes = rows_per_expert[:num_experts]
    sizes.append(expert_ids.numel() - sum(sizes))  # sentinel ids (>= E) sort last
    intermediate = down_proj.shape[2]
    gate_up = _grouped_project(sorted_rows, gate_up_proj, sizes, differentiable)  # [S, 2I]
    hidden = act(gate_up[:, :intermediate]) * gate_up[:, intermediate:]  # one activation for every pair
    expert_out = _grouped_project(hidden, down_proj, sizes, differentiable)  # [S, H]

    pair_weights = top_k_weights.reshape(-1)[order].to(torch.float32)
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden_states.device)
    out.index_add_(0, token_of_pair, expert_out.to(torch.float32) * pair_weights[:, None])
    return out.to(hidden_states.dtype)

