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
- fp32 with m <= 3: `x @ W.T` (MKL's small-m kernel is still at bandwidth there), all such experts in one
  call of torch's grouped GEMM, whose C++ loop saves the per-expert Python dispatches;
- m == 1 otherwise (bf16 decode): a GEMV (`torch.mv`), ~20% faster than either GEMM orientation;
- otherwise weight-major, `(W @ x.T).T`: the weight becomes the tall M side that the library streams once
  and the few tokens the narrow N side, 17-20 GB/s fp32 (oneDNN) and 22-29 GB/s bf16, 1.3-1.9x per expert.
Routing is sorted once, each active expert works on one contiguous slice of the gathered rows and writes
its slice of one output buffer, and the weighted results are scattered back in fp32.

Those defaults were measured on one CPU; another one orders the engines differently (on one thread of a 2-core AMD EPYC with
AVX512-BF16, bf16 `x @ W.T` streams at 15-18 GB/s for 1-8 rows where the weight-major GEMM and `torch.mv` stay
at 11-12). So a caller may pass `ops`, one engine per row-count class (`row_class`), which the CPU dispatch
measures per machine (`cpu_dispatch`):
- "grouped": the expert joins one call of torch's grouped GEMM with every other expert of its op;
- "mv": a GEMV per projection (one row only; more rows fall back to "row");
- "row": `x @ W.T`;
- "wm": weight-major `(W @ x.T).T` (oneDNN for large fp32 weights);
- "skinny": layerswap's own kernel (`cpu_native`, built on first use) for bf16 and fp32, which streams the
  weight at ~95% of the memory's read bandwidth for 1-3 rows; fp16, or where the kernel cannot be built, runs
  as "wm".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from itertools import accumulate

import torch
import torch.nn.functional as F

from . import _workers, cpu_native

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


# The engines an expert's MLP can run on (see the module docstring), and the row-count classes an `ops` tuple
# gives one engine each: class c holds 2**c to 2**(c+1) - 1 rows, the last class every count above.
EXPERT_OPS = ("grouped", "mv", "row", "wm", "skinny")
ROW_CLASSES = 7  # 1, 2-3, 4-7, 8-15, 16-31, 32-63, 64+


def row_class(rows: int) -> int:
    """The row-count class of an expert with `rows` (>= 1) rows: its index into an `ops` tuple."""
    return min(rows.bit_length() - 1, ROW_CLASSES - 1)


def default_ops(dtype: torch.dtype) -> tuple[str, ...]:
    """The engines used when no measurement says otherwise (the choices measured on AVX-512/AMX CPUs)."""
    small = [row_class(rows) for rows in range(1, _FP32_WEIGHT_MAJOR_MIN_ROWS)]
    if dtype == torch.float32:
        if _CPU_GROUPED_MM:
            return tuple("grouped" if c in small else "wm" for c in range(ROW_CLASSES))
        return tuple("mv" if c == 0 else "row" if c in small else "wm" for c in range(ROW_CLASSES))
    return ("mv",) + ("wm",) * (ROW_CLASSES - 1)


def check_ops(ops: tuple[str, ...]) -> None:
    if len(ops) != ROW_CLASSES or not set(ops) <= set(EXPERT_OPS):
        raise ValueError(
            f"ops must give one of {EXPERT_OPS} for each of the {ROW_CLASSES} row-count classes, got {ops!r}"
        )


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


SKINNY_DTYPES = (torch.bfloat16, torch.float32)  # what layerswap's kernel computes


# SiLU modules whose forward is F.silu: torch's, and transformers' ACT2FN["silu"] (named, not imported: kernels/
# does not import transformers).
_SILU_MODULES = {("torch.nn.modules.activation", "SiLU"), ("transformers.activations", "SiLUActivation")}


def _is_silu(act: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether `act` is plain SiLU, which the kernel computes inside its gated-MLP call: F.silu, or a SiLU module
    with no hook and no forward of its own set on it (a hook would not see the kernel's SiLU)."""
    if act is F.silu:
        return True
    kind = type(act)
    return (
        (kind.__module__, kind.__qualname__) in _SILU_MODULES
        and not act._forward_hooks
        and not act._forward_pre_hooks
        and "forward" not in act.__dict__
    )


def skinny_applies(inputs: torch.Tensor, weight: torch.Tensor, differentiable: bool) -> bool:
    """Whether engine "skinny" runs layerswap's kernel on these operands (else it runs as "wm")."""
    return (
        not differentiable
        and inputs.dtype == weight.dtype
        and inputs.dtype in SKINNY_DTYPES
        and inputs.device.type == "cpu"
        and cpu_native.available()
    )


def batches_on_kernel(
    inputs: torch.Tensor,
    weights: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor],
    act: Callable[[torch.Tensor], torch.Tensor],
) -> bool:
    """Whether an expert on engine "skinny" with these (gate or None, up, down) weights joins one kernel call with
    the layer's other such experts (`linear_experts_on_kernel`): a gated SiLU MLP the kernel computes whole."""
    return (
        weights[0] is not None and _is_silu(act) and skinny_applies(inputs, weights[1], differentiable=False)
    )


def linear_experts_on_kernel(
    rows: torch.Tensor,
    weights: Sequence[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]],
    bounds: Sequence[int],
    out: torch.Tensor,
) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) of several experts held as separate projections, in one kernel call: expert j
    (`weights[j]`, each passing `batches_on_kernel`) on rows `bounds[2j]:bounds[2j + 1]` of `rows`, into `out`."""
    return cpu_native.skinny_silu_experts(
        rows, [w[0] for w in weights], [w[1] for w in weights], [w[2] for w in weights], bounds, out
    )


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


def _expert_mlp(
    rows: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    out: torch.Tensor | None = None,
    op: str | None = None,
) -> torch.Tensor:
    """down(act(gate(rows)) * up(rows)) for one expert's contiguous slice of rows: [m, H] -> [m, H], on engine
    `op` ("mv", "row" or "wm"; None: the default for this row count and dtype). Writes into `out` when given
    (saves a copy; `out=` variants have no backward, so only without autograd)."""
    intermediate = down.shape[1]
    differentiable = out is None
    if op is None:
        op = default_ops(rows.dtype)[row_class(rows.shape[0])]
        if op == "grouped":  # alone, the grouped GEMM's one expert is a GEMV or an x @ W.T
            op = "mv" if rows.shape[0] == 1 else "row"
    if op == "skinny":
        if skinny_applies(rows, gate_up, differentiable):
            if _is_silu(act):
                gate, up = gate_up[:intermediate], gate_up[intermediate:]
                return cpu_native.skinny_silu_mlp(rows, gate, up, down, out)
            gate_up_out = cpu_native.skinny_mm(rows, gate_up)
            hidden = act(gate_up_out[:, :intermediate]) * gate_up_out[:, intermediate:]
            return cpu_native.skinny_mm(hidden, down, out)
        op = "wm"
    if op == "mv" and rows.shape[0] == 1:
        # One row: a plain GEMV (on AVX-512/AMX CPUs ~20% faster for bf16 than either GEMM orientation, where
        # oneDNN treats a 1-column GEMM as a GEMM; for fp32 it ties with MKL's x @ W.T).
        gate_up_v = torch.mv(gate_up, rows[0])
        hidden_v = act(gate_up_v[:intermediate]) * gate_up_v[intermediate:]
        if out is None:
            return torch.mv(down, hidden_v)[None]
        torch.mv(down, hidden_v, out=out[0])
        return out
    if op == "wm":
        # Kept transposed from end to end: [2I, m] -> act -> [I, m] is already the down GEMM's right operand,
        # so the only transposed copy is of the result (on 2-core CPUs a skinny transpose copies at ~3 GB/s).
        gate_up_t = _weight_major_mm(gate_up, rows, differentiable)
        hidden_t = act(gate_up_t[:intermediate]) * gate_up_t[intermediate:]
        result = _weight_major_mm(down, hidden_t.t(), differentiable).t()  # a transposed [H, m] view
        return result if out is None else out.copy_(result)
    gate_up_out = torch.mm(rows, gate_up.t())
    hidden = act(gate_up_out[:, :intermediate]) * gate_up_out[:, intermediate:]
    return torch.mm(hidden, down.t()) if out is None else torch.mm(hidden, down.t(), out=out)


# The engines of an expert held as three separate projections (`-quant`'s nn.Linear experts): "row" is what
# nn.Linear itself computes, `x @ W.T`, so it is the reference the others must beat.
LINEAR_EXPERT_OPS = ("row", "mv", "wm", "skinny")


def linear_expert_mlp(
    rows: torch.Tensor,
    gate: torch.Tensor | None,
    up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    op: str,
) -> torch.Tensor:
    """down(act(gate(rows)) * up(rows)) (down(act(up(rows))) without a gate) for one expert whose projections are
    separate weights (`gate`, `up` [I, H], `down` [H, I], no bias): [m, H] -> [m, H], on engine `op` of
    `LINEAR_EXPERT_OPS`. "row" computes exactly what the three nn.Linear calls compute; "mv" (one row) and
    "wm" (weight-major, `(W @ x.T).T`) and "skinny" (bf16/fp32; else as "wm") are the engines `_expert_mlp` runs
    on fused weights."""
    if op == "skinny":
        if skinny_applies(rows, up, differentiable=False):
            if gate is not None and _is_silu(act):
                return cpu_native.skinny_silu_mlp(rows, gate, up, down)
            up_out = cpu_native.skinny_mm(rows, up)
            hidden = act(up_out) if gate is None else act(cpu_native.skinny_mm(rows, gate)) * up_out
            return cpu_native.skinny_mm(hidden, down)
        op = "wm"
    if op == "mv" and rows.shape[0] == 1:
        vector = rows[0]
        up_v = torch.mv(up, vector)
        hidden_v = act(up_v) if gate is None else act(torch.mv(gate, vector)) * up_v
        return torch.mv(down, hidden_v)[None]
    if op == "wm":
        up_t = _weight_major_mm(up, rows, differentiable=False)
        hidden_t = (
            act(up_t) if gate is None else act(_weight_major_mm(gate, rows, differentiable=False)) * up_t
        )
        return _weight_major_mm(down, hidden_t.t(), differentiable=False).t()
    up_out = F.linear(rows, up)
    hidden = act(up_out) if gate is None else act(F.linear(rows, gate)) * up_out
    return F.linear(hidden, down)


def _gemv_experts_grouped(
    sorted_rows: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    sizes: list[int],
    experts: list[int],
    out: torch.Tensor | None,
) -> torch.Tensor:
    """The MLP of `experts` through torch's grouped GEMM, the C++ loop that stock grouped_mm runs: where
    `x @ W.T` is already the fastest engine (fp32 with 1-3 rows on MKL), it saves one Python dispatch per
    expert, 2-8% of the layer at T=16 with 80 active experts.
    `out=None`: `experts` are all the active experts, so no rows need gathering; returns the [S, H] result."""
    num_experts = gate_up_proj.shape[0]
    intermediate = down_proj.shape[2]
    if out is None:
        rows, group_sizes = sorted_rows, sizes[:num_experts]
    else:
        chosen = set(experts)
        starts = list(accumulate(sizes, initial=0))
        index = torch.tensor([r for e in sorted(chosen) for r in range(starts[e], starts[e + 1])])
        rows, group_sizes = sorted_rows[index], [sizes[e] if e in chosen else 0 for e in range(num_experts)]
    offsets = torch.tensor(list(accumulate(group_sizes)), dtype=torch.int32)
    gate_up = _GROUPED_MM(rows, gate_up_proj.transpose(1, 2), offs=offsets)  # views, as stock passes them
    hidden = act(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    result = _GROUPED_MM(hidden, down_proj.transpose(1, 2), offs=offsets)
    if out is None:
        if sizes[-1]:
            result[rows.shape[0] - sizes[-1] :].zero_()  # rows past the last offset are left unwritten
        return result
    return out.index_copy_(0, index, result)


def _skinny_experts(
    sorted_rows: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    experts: list[int],
    starts: list[int],
    out: torch.Tensor,
) -> None:
    """The SiLU MLP of `experts` on layerswap's kernel, in one call: expert e on rows starts[e]:starts[e + 1]."""
    intermediate = down_proj.shape[2]
    gate_ups = [gate_up_proj[e] for e in experts]
    cpu_native.skinny_silu_experts(
        sorted_rows,
        [gate_up[:intermediate] for gate_up in gate_ups],
        [gate_up[intermediate:] for gate_up in gate_ups],
        [down_proj[e] for e in experts],
        [bound for e in experts for bound in (starts[e], starts[e + 1])],
        out,
    )


def _all_experts(
    sorted_rows: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    sizes: list[int],
    differentiable: bool,
    ops: tuple[str, ...],
    workers: int = 1,
) -> torch.Tensor:
    """Every pair's expert output, [S, H], for rows sorted by expert (`sizes[e]` rows for expert e, then a
    tail of sentinel pairs, which get zeros); each expert on the engine `ops` gives its row count, and with
    `workers` > 1 the experts split over that many single-threaded worker threads."""
    num_experts = gate_up_proj.shape[0]
    active = [e for e in range(num_experts) if sizes[e]]
    # Slices of the active experts only, not a split into every expert's slice (most of them empty at decode):
    # side by side on a Zen 3, a bf16 decode call took 0.65x the time with 128 tiny experts, 0.92x with a
    # Qwen3-30B-A3B layer's.
    starts = list(accumulate(sizes, initial=0))
    if differentiable:
        pieces = [
            _expert_mlp(sorted_rows[starts[e] : starts[e + 1]], gate_up_proj[e], down_proj[e], act)
            for e in active
        ]
        return torch.cat([*pieces, sorted_rows.new_zeros(sizes[-1], sorted_rows.shape[1])])

    op_of = {e: ops[row_class(sizes[e])] for e in active}
    can_group = _CPU_GROUPED_MM and sorted_rows.device.type == "cpu"
    if workers == 1 and can_group and all(op == "grouped" for op in op_of.values()):  # decode, small batches
        return _gemv_experts_grouped(sorted_rows, gate_up_proj, down_proj, act, sizes, active, None)
    expert_out = torch.empty_like(sorted_rows)
    batch_skinny = _is_silu(act) and skinny_applies(sorted_rows, gate_up_proj, differentiable=False)

    def run(experts: list[int]) -> None:
        grouped = [e for e in experts if op_of[e] == "grouped"] if can_group else []
        if grouped:
            _gemv_experts_grouped(sorted_rows, gate_up_proj, down_proj, act, sizes, grouped, expert_out)
        skinny = [e for e in experts if op_of[e] == "skinny"] if batch_skinny else []
        if skinny:
            _skinny_experts(sorted_rows, gate_up_proj, down_proj, skinny, starts, expert_out)
        for e in experts:
            op = op_of[e]
            if (op == "grouped" and can_group) or (op == "skinny" and batch_skinny):
                continue  # done above, in one call
            op = "row" if op == "grouped" else op  # no grouped GEMM in this torch
            rows = slice(starts[e], starts[e + 1])
            _expert_mlp(sorted_rows[rows], gate_up_proj[e], down_proj[e], act, out=expert_out[rows], op=op)

    if workers > 1:
        # An expert's cost: streaming its weights, plus its rows' FLOPs (which dominate from ~16 rows on).
        costs = [1.0 + sizes[e] / 16 for e in active]
        _workers.run_split(run, _workers.balanced_groups(active, costs, workers), workers)
    else:
        run(active)
    if sizes[-1]:
        expert_out[starts[-2] :].zero_()
    return expert_out


def fused_moe_reference(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    activation: Activation = "silu",
    ops: tuple[str, ...] | None = None,
    workers: int = 1,
) -> torch.Tensor:
    """MoE experts forward in plain PyTorch.

    Args:
        hidden_states: `[T, H]`.
        gate_up_proj: `[E, 2I, H]`, gate rows first, then up rows.
        down_proj: `[E, H, I]`.
        top_k_index: `[T, K]` integer expert ids. Ids >= E (expert-parallel sentinels) contribute nothing.
        top_k_weights: `[T, K]` routing weights, multiplied in fp32.
        activation: an ACT2FN name ("silu", "gelu", "gelu_pytorch_tanh", "relu") or an elementwise callable.
        ops: the engine per row-count class (`EXPERT_OPS`, `row_class`) when no gradient is needed; None: the
            defaults (`default_ops`). A gradient-tracking call uses the default engines.
        workers: with no gradient needed, run the experts on this many single-threaded worker threads
            (`_workers`), each taking whole experts; 1: in the calling thread.

    Returns:
        `[T, H]` in `hidden_states.dtype`. Differentiable when autograd needs it.
    """
    act = resolve_activation(activation)
    if ops is None:
        ops = default_ops(gate_up_proj.dtype)
    else:
        check_ops(ops)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
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
    expert_out = _all_experts(sorted_rows, gate_up_proj, down_proj, act, sizes, differentiable, ops, workers)

    pair_weights = top_k_weights.reshape(-1)[order].to(torch.float32)
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden_states.device)
    if differentiable or out.device.type != "cpu":
        out.index_add_(0, token_of_pair, expert_out.to(torch.float32) * pair_weights[:, None])
    else:
        _add_weighted(out, token_of_pair, expert_out, pair_weights)
    return out.to(hidden_states.dtype)


_WEIGHTED_CHUNK_BYTES = 4 << 20


def _add_weighted(
    out: torch.Tensor, token_of_pair: torch.Tensor, expert_out: torch.Tensor, pair_weights: torch.Tensor
) -> None:
    """out[token_of_pair[i]] += expert_out[i] * pair_weights[i] in fp32, through one reused buffer of at most
    4 MiB instead of an fp32 copy of every pair's output: at 512 tokens of a top-8 layer that copy is 32 MB of
    fresh memory a call, and its page faults made the weighting 16x slower (26 ms against 1.6 on a Zen 4, the
    same sums in the same order)."""
    pairs, hidden = expert_out.shape
    rows = max(1, min(pairs, _WEIGHTED_CHUNK_BYTES // (4 * hidden)))
    buffer = torch.empty(rows, hidden, dtype=torch.float32, device=out.device)
    for start in range(0, pairs, rows):
        stop = min(start + rows, pairs)
        chunk = buffer[: stop - start].copy_(expert_out[start:stop]).mul_(pair_weights[start:stop, None])
        out.index_add_(0, token_of_pair[start:stop], chunk)
