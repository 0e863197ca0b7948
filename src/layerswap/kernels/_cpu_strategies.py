"""The strategies the CPU path chooses between (by measurement, in `cpu_dispatch`), all with one signature:

    strategy(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, act, plan) -> [T, H]

- `stock`: the computation of transformers' `grouped_mm` experts backend, op for op (one sort, one gather,
  torch's grouped GEMM over every expert, one unpermute and a sum over top_k), so picking it costs nothing
  against stock.
- `layerswap`: `fused_moe_reference`, the per-expert path, each expert on the engine (`torch_moe.EXPERT_OPS`:
  grouped GEMM, GEMV, `x @ W.T` or weight-major) that this machine measured fastest for its row count
  (`plan.ops`; empty: the defaults measured on AVX-512/AMX CPUs, where oneDNN's weight-major bf16 GEMM
  streams at bandwidth).
- `upcast`: for reduced-precision weights on CPUs without a native bf16/fp16 GEMM (AVX2 only, e.g. AMD Zen 2/3).
  There torch's bf16 GEMM for more than one row is a scalar-speed single-threaded loop: its time grows with the
  row count (about one GEMV per row), 5-10x a fp32 GEMM at 16-64 rows. So each expert with at least
  `plan.min_rows` rows has its weights converted, block by block, into an fp32 scratch that stays in cache
  and is multiplied there by MKL/oneDNN's fp32 GEMM; experts with fewer rows, where the conversion would
  cost more than it saves, run torch's bf16 GEMV-speed grouped GEMM as stock does. Accumulates in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from . import torch_moe

Act = Callable[[torch.Tensor], torch.Tensor]

# Fallback when a plan does not say: converted weight blocks of 8 MiB of fp32 stay in a 16-32 MiB L3 and keep
# the number of (copy, GEMM) pairs per expert at 1-3 for 1-3k x 2k projections.
DEFAULT_BLOCK_BYTES = 8 << 20
DEFAULT_MIN_ROWS = 4


@dataclass(frozen=True)
class Plan:
    """What the CPU path runs for one (dtype, token bucket, shape): a strategy and its blocking parameters.

    min_rows: `upcast` converts an expert's weights to fp32 from this many rows on (fewer: torch's own GEMM).
    block_bytes: `upcast` converts weights in row blocks of at most this many fp32 bytes.
    ops: `layerswap` runs an expert with r rows on engine `ops[torch_moe.row_class(r)]`; () for the defaults.
    workers: `layerswap` splits the experts over this many single-threaded worker threads (1: none).
    source: how the plan was chosen ("calibrated", "rule", "forced", "cached"), for reports and benchmarks.
    """

    strategy: str
    min_rows: int = DEFAULT_MIN_ROWS
    block_bytes: int = DEFAULT_BLOCK_BYTES
    ops: tuple[str, ...] = ()
    workers: int = 1
    source: str = field(default="rule", compare=False)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown CPU strategy {self.strategy!r}: expected one of {sorted(STRATEGIES)}")
        if self.min_rows < 1:
            raise ValueError(f"Plan.min_rows must be >= 1, got {self.min_rows}")
        if self.block_bytes < 4096:
            raise ValueError(f"Plan.block_bytes must be >= 4096, got {self.block_bytes}")
        if self.ops:
            torch_moe.check_ops(self.ops)
        if self.workers < 1:
            raise ValueError(f"Plan.workers must be >= 1, got {self.workers}")

    @property
    def label(self) -> str:
        """The candidate's name in a calibration: the strategy, with its worker count where it has workers."""
        return self.strategy if self.workers == 1 else f"{self.strategy}x{self.workers}"

    def describe(self) -> str:
        if self.strategy == "upcast":
            return f"upcast(min_rows={self.min_rows}, block={self.block_bytes >> 10} KiB)"
        if self.strategy == "layerswap" and (self.ops or self.workers > 1):
            workers = f"; {self.workers} workers" if self.workers > 1 else ""
            return f"layerswap({describe_ops(self.ops) if self.ops else 'default engines'}{workers})"
        return self.strategy


def describe_ops(ops: tuple[str, ...]) -> str:
    """`ops` as row ranges per engine, e.g. "1:mv 2-7:row 8+:wm"."""
    lows = [1 << c for c in range(len(ops))]
    parts, start = [], 0
    for index in range(1, len(ops) + 1):
        if index == len(ops) or ops[index] != ops[start]:
            low = lows[start]
            high = "+" if index == len(ops) else ("" if lows[index] - 1 == low else f"-{lows[index] - 1}")
            parts.append(f"{low}{high}:{ops[start]}")
            start = index
    return " ".join(parts)


def _grouped_or_loop(rows: torch.Tensor, weights_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM (what stock grouped_mm calls), or its per-group loop where torch has none."""
    # Stock's condition: torch <= 2.10's CPU kernel needs 16-byte aligned operands (mmapped checkpoints may not be).
    aligned = torch_moe._TORCH_VERSION > (2, 10) or (
        rows.data_ptr() % 16 == 0 and weights_t.data_ptr() % 16 == 0
    )
    if torch_moe._CPU_GROUPED_MM and aligned:
        return torch_moe._GROUPED_MM(rows, weights_t, offs=offsets)
    out = rows.new_empty(rows.shape[0], weights_t.shape[-1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(rows[start:end], weights_t[expert], out=out[start:end])
        start = end
    return out


def grouped_expert_mlp(
    rows: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, expert: int, act: Act
) -> torch.Tensor:
    """One expert's MLP on `rows` through the grouped GEMM stock runs (a group of one): what an expert costs
    there, for the calibration to weigh against the other engines."""
    offsets = torch.tensor([rows.shape[0]], dtype=torch.int32)
    one = slice(expert, expert + 1)
    gate, up = _grouped_or_loop(rows, gate_up_proj[one].transpose(1, 2), offsets).chunk(2, dim=-1)
    return _grouped_or_loop(act(gate) * up, down_proj[one].transpose(1, 2), offsets)


def stock(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    act: Act,
    plan: Plan,
) -> torch.Tensor:
    """transformers' grouped_mm_experts_forward for group-A experts, plus zeros for ids >= E (which stock
    leaves to expert-parallel modules)."""
    num_tokens, hidden_size = hidden_states.shape
    num_experts = gate_up_proj.shape[0]
    top_k = top_k_index.shape[-1]
    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))
    selected = hidden_states[perm // top_k].to(gate_up_proj.dtype)
    sample_weights_g = top_k_weights.reshape(-1)[perm]
    tokens_per_expert = torch.histc(expert_ids_g.float(), bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    proj = _grouped_or_loop(selected, gate_up_proj.transpose(-2, -1), offsets)
    gate, up = proj.chunk(2, dim=-1)
    proj = _grouped_or_loop(act(gate) * up, down_proj.transpose(-2, -1), offsets)
    valid = int(offsets[-1]) if num_experts else 0
    if valid < proj.shape[0]:
        proj[valid:] = 0  # rows past the last offset are left unwritten (sentinel ids sort last)
    weighted = proj * sample_weights_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.numel(), device=perm.device)
    return weighted[inv_perm].view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden_states.dtype)


def layerswap(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    act: Act,
    plan: Plan,
) -> torch.Tensor:
    return torch_moe.fused_moe_reference(
        hidden_states,
        gate_up_proj,
        down_proj,
        top_k_index,
        top_k_weights,
        activation=act,
        ops=plan.ops or None,
        workers=plan.workers,
    )


def _block_rows(columns: int, block_bytes: int) -> int:
    return max(1, block_bytes // (4 * columns))


def upcast_weight_major_mm(
    weight: torch.Tensor, inputs32: torch.Tensor, scratch: torch.Tensor, block_bytes: int
) -> torch.Tensor:
    """`weight.float() @ inputs32.T` ([N, K] reduced x [m, K] fp32 -> [N, m] fp32), converting `weight` one
    row block at a time into `scratch` (fp32, at least one block), so it is read from memory once, in its
    own dtype, and the fp32 copy never leaves the cache."""
    rows, columns = weight.shape
    step = _block_rows(columns, block_bytes)
    if step >= rows:
        converted = scratch[: weight.numel()].view(rows, columns).copy_(weight)
        return torch_moe._weight_major_mm(converted, inputs32, False)
    out = inputs32.new_empty(rows, inputs32.shape[0])
    for start in range(0, rows, step):
        block = weight[start : start + step]
        converted = scratch[: block.numel()].view(block.shape).copy_(block)
        out[start : start + step] = torch_moe._weight_major_mm(converted, inputs32, False)
    return out


def upcast_expert_mlp(
    rows: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Act,
    out32: torch.Tensor,
    scratch: torch.Tensor,
    block_bytes: int,
) -> None:
    """One expert's MLP with its reduced-precision weights converted to fp32 in cache: writes `out32` [m, H]."""
    intermediate = down.shape[1]
    rows32 = rows.to(torch.float32)
    gate_up_t = upcast_weight_major_mm(gate_up, rows32, scratch, block_bytes)  # [2I, m]
    hidden_t = act(gate_up_t[:intermediate]) * gate_up_t[intermediate:]  # [I, m]
    out32.copy_(upcast_weight_major_mm(down, hidden_t.t(), scratch, block_bytes).t())


def scratch_numel(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, block_bytes: int) -> int:
    """fp32 elements of the conversion buffer: one block of either projection."""
    _, two_i, hidden = gate_up_proj.shape
    intermediate = down_proj.shape[2]
    return max(
        min(two_i, _block_rows(hidden, block_bytes)) * hidden,
        min(hidden, _block_rows(intermediate, block_bytes)) * intermediate,
    )


def upcast(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    act: Act,
    plan: Plan,
) -> torch.Tensor:
    if gate_up_proj.dtype == torch.float32:  # nothing to convert: the per-expert fp32 path is this strategy
        return layerswap(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, act, plan)
    num_tokens, hidden_size = hidden_states.shape
    num_experts = gate_up_proj.shape[0]
    top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)
    token_of_pair = order // top_k
    sizes = torch.bincount(expert_ids, minlength=num_experts).tolist()[:num_experts]
    sizes.append(expert_ids.numel() - sum(sizes))  # sentinel ids (>= E) sort last
    sorted_rows = hidden_states[token_of_pair].to(gate_up_proj.dtype)

    active = [e for e in range(num_experts) if sizes[e]]
    converted = [e for e in active if sizes[e] >= plan.min_rows]
    direct = [e for e in active if sizes[e] < plan.min_rows]
    expert_out = torch.empty(sorted_rows.shape, dtype=torch.float32)
    starts = list(accumulate(sizes, initial=0))
    if direct:
        index = torch.tensor([r for e in direct for r in range(starts[e], starts[e + 1])])
        chosen = set(direct)
        group_sizes = [sizes[e] if e in chosen else 0 for e in range(num_experts)]
        offsets = torch.tensor(list(accumulate(group_sizes)), dtype=torch.int32)
        rows = sorted_rows[index]
        gate, up = _grouped_or_loop(rows, gate_up_proj.transpose(1, 2), offsets).chunk(2, dim=-1)
        result = _grouped_or_loop(act(gate) * up, down_proj.transpose(1, 2), offsets)
        expert_out.index_copy_(0, index, result.to(torch.float32))
    if converted:
        scratch = torch.empty(scratch_numel(gate_up_proj, down_proj, plan.block_bytes), dtype=torch.float32)
        for e in converted:
            upcast_expert_mlp(
                sorted_rows[starts[e] : starts[e + 1]],
                gate_up_proj[e],
                down_proj[e],
                act,
                expert_out[starts[e] : starts[e + 1]],
                scratch,
                plan.block_bytes,
            )
    if sizes[-1]:
        expert_out[starts[-2] :].zero_()

    pair_weights = top_k_weights.reshape(-1)[order].to(torch.float32)
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32)
    out.index_add_(0, token_of_pair, expert_out.mul_(pair_weights[:, None]))
    return out.to(hidden_states.dtype)


STRATEGIES: dict[str, Callable[..., torch.Tensor]] = {
    "stock": stock,
    "layerswap": layerswap,
    "upcast": upcast,
}
