"""Triton fused-MoE experts: routing alignment, two grouped GEMM kernels, and their launcher.

Imported lazily by `layerswap.kernels.fused_moe` (this is the only module that needs triton).

Design (the vLLM fused_moe scheme, written from its description):
1. `align_routing` sorts the T*K token-expert pairs by expert and pads every expert's run to a multiple of
   BLOCK_M, so each BLOCK_M-row block belongs to exactly one expert. It runs as a handful of torch ops on the
   device with static output sizes: no `.item()`, no data-dependent shapes, CUDA-graph capturable. The grid is
   sized by the static upper bound on blocks; blocks past the real padded length exit at once.
2. `_gate_up_act_kernel` gathers each block's input rows through the sorted pair ids and multiplies them by the
   block's expert `gate_up_proj[e]`, read in place through its strides. The activation is fused: each program
   accumulates the gate tile and the matching up tile (rows n and n + I of the same weight) and stores only
   `act(gate) * up`. Why fused rather than a separate act-and-mul kernel: it never writes or re-reads the
   [T*K, 2I] pre-activation buffer and saves a launch, which matters at decode where the whole layer is a few
   microseconds; the cost is a second accumulator, so the per-half tile width BLOCK_N is kept <= 128.
3. `_down_weighted_kernel` multiplies the activations by `down_proj[e]`, scales each row by its routing
   weight in fp32 before the store, and writes one row per pair; summing over top_k gives the output, in a
   fixed order (no atomics, so results are deterministic).
Accumulation is fp32 throughout. fp32 inputs use IEEE dots (Triton's default for fp32 is TF32).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .configs import TileConfig, activation_code, get_tile_config


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    # Codes match configs.activation_code; x is fp32.
    if ACTIVATION == 0:  # silu
        return x / (1.0 + tl.exp(-x))
    elif ACTIVATION == 1:  # gelu (erf)
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == 2:  # gelu, tanh approximation; tanh(y) = 2 * sigmoid(2y) - 1
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return 0.5 * x * (2.0 / (1.0 + tl.exp(-2.0 * inner)))
    else:  # relu
        return tl.maximum(x, 0.0)


@triton.jit
def _tile_ids(num_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped launch order: GROUP_M consecutive row blocks sweep all column tiles before the next group, so
    # their gathered input rows stay in L2 across column tiles (row-major order would re-read every pair's
    # row once per column tile) while each expert's weight tiles are still read about once.
    pid = tl.program_id(0)
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N  # not tl.cdiv: see the note on tl.full below
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_blocks - first_m, GROUP_M)
    in_group = pid % (GROUP_M * num_pid_n)
    return first_m + in_group % group_size, in_group // group_size


@triton.jit
def _gate_up_act_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    num_blocks,
    top_k,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[pair, n] = act(x[token] . w[e, n]) * (x[token] . w[e, N + n]) for the block's BLOCK_M pairs."""
    pid_m, pid_n = _tile_ids(num_blocks, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + offs_m)
    row_mask = pair < num_pairs  # padding slots hold num_pairs
    token = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :] * stride_xk
    # [BLOCK_K, BLOCK_N] tile of w[e]^T, read in place; the up rows start N rows after the gate rows.
    gate_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    up_ptrs = gate_ptrs + N * stride_wn

    # tl.full, not tl.zeros: tl.zeros is itself a @triton.jit helper, created when triton is imported, and
    # Triton's interpreter cannot call it if triton was imported before TRITON_INTERPRET=1 was set (as in a
    # test session where transformers imports triton first). Builtins like tl.full, tl.exp work either way.
    acc_gate = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k_start
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        acc_gate = tl.dot(
            x, tl.load(gate_ptrs, mask=w_mask, other=0.0), acc_gate, input_precision=DOT_PRECISION
        )
        acc_up = tl.dot(x, tl.load(up_ptrs, mask=w_mask, other=0.0), acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk

    hidden = _activation(acc_gate, ACTIVATION) * acc_up
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, hidden.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_weighted_kernel(
    h_ptr,
    w_ptr,
    out_ptr,
    routing_weights_ptr,
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    num_blocks,
    N,
    K,
    stride_hm,
    stride_hk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[pair, n] = routing_weight[pair] * (h[pair] . w[e, n]), the weight applied in fp32."""
    pid_m, pid_n = _tile_ids(num_blocks, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + offs_m)
    row_mask = pair < num_pairs
    pair64 = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    h_ptrs = h_ptr + pair64[:, None] * stride_hm + offs_k[None, :] * stride_hk
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k_start
        h = tl.load(h_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_K * stride_hk
        w_ptrs += BLOCK_K * stride_wk

    routing_weight = tl.load(routing_weights_ptr + pair64, mask=row_mask, other=0.0)  # fp32
    acc = acc * routing_weight[:, None]
    out_ptrs = out_ptr + pair64[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def align_routing(
    top_k_index: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort token-expert pairs by expert into BLOCK_M-padded blocks, on the device, without a host sync.

    Returns:
        sorted_pair_ids: `[P]` int32, pair ids (t * K + k) grouped by expert; padding slots hold T*K.
        block_expert_ids: `[P // block_m]` int32, the expert of each block (`num_experts` past the end).
        num_padded: `[1]` int32, the real padded length; blocks at or past it do nothing.
    P is a static bound (T*K plus up to block_m - 1 padding per active expert), so every shape depends on the
    input shapes only. Ids outside [0, E) (expert-parallel sentinels) are left out: their pairs add zero.
    """
    device = top_k_index.device
    num_pairs = top_k_index.numel()
    max_active = min(num_experts, num_pairs)
    padded_bound = triton.cdiv(num_pairs + max_active * (block_m - 1), block_m) * block_m

    expert_ids = top_k_index.reshape(-1).to(torch.int64)
    valid = (expert_ids >= 0) & (expert_ids < num_experts)
    bucket = torch.where(valid, expert_ids, num_experts)  # one overflow bucket for sentinels
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))  # unlike bincount, a static output size
    counts = counts[:num_experts]
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded_counts, 0)
    padded_starts = padded_ends - padded_counts
    starts = torch.cumsum(counts, 0) - counts

    sorted_buckets, order = torch.sort(bucket, stable=True)
    clamped = sorted_buckets.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=device) - starts[clamped]
    destination = torch.where(sorted_buckets < num_experts, padded_starts[clamped] + rank, padded_bound)

    sorted_pair_ids = torch.full((padded_bound + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, destination, order.to(torch.int32))  # sentinels land in the dropped last slot
    block_starts = torch.arange(0, padded_bound, block_m, device=device)
    block_expert_ids = torch.searchsorted(padded_ends, block_starts, right=True).to(torch.int32)
    num_padded = padded_ends[-1:].to(torch.int32)
    return sorted_pair_ids[:padded_bound], block_expert_ids, num_padded


@functools.lru_cache(maxsize=8)
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}-interpreter"


def _dot_precision(dtype: torch.dtype) -> str | None:
    # Triton's default for fp32 dots is TF32 (10-bit mantissa); the fp32 path must match PyTorch's fp32 GEMM.
    return "ieee" if dtype == torch.float32 else None


def fused_moe_triton(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    activation: str,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """Launch the two kernels. Shapes are checked by the caller (`layerswap.kernels.fused_moe`)."""
    num_tokens, hidden_size = hidden_states.shape
    num_experts, two_intermediate, _ = gate_up_proj.shape
    intermediate = two_intermediate // 2
    top_k = top_k_index.shape[-1]
    num_pairs = num_tokens * top_k
    compute_dtype = gate_up_proj.dtype
    device = hidden_states.device
    if config is None:
        config = get_tile_config(num_experts, intermediate, _device_name(device), num_tokens)
    if num_pairs == 0:
        return hidden_states.new_zeros(num_tokens, hidden_size)

    # Like the stock backends, compute in the weights' dtype (autocast can hand us fp32 activations).
    x = hidden_states.to(compute_dtype)
    sorted_pair_ids, block_expert_ids, num_padded = align_routing(top_k_index, num_experts, config.block_m)
    num_blocks = block_expert_ids.numel()
    precision = _dot_precision(compute_dtype)
    # fp32 tiles take twice the shared memory of 16-bit ones; two stages keep the defaults within 100 KB.
    stages = min(config.num_stages, 2) if compute_dtype == torch.float32 else config.num_stages
    launch = {"num_warps": config.num_warps, "num_stages": stages}

    hidden = torch.empty(num_pairs, intermediate, dtype=compute_dtype, device=device)
    _gate_up_act_kernel[(num_blocks * triton.cdiv(intermediate, config.block_n),)](
        x,
        gate_up_proj,
        hidden,
        sorted_pair_ids,
        block_expert_ids,
        num_padded,
        num_pairs,
        num_blocks,
        top_k,
        intermediate,
        hidden_size,
        x.stride(0),
        x.stride(1),
        *gate_up_proj.stride(),
        *hidden.stride(),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        ACTIVATION=activation_code(activation),
        DOT_PRECISION=precision,
        **launch,
    )

    # Zeroed, not empty: pairs routed to a sentinel id are never written by the kernel.
    per_pair = torch.zeros(num_pairs, hidden_size, dtype=compute_dtype, device=device)
    routing_weights = top_k_weights.reshape(-1).to(torch.float32).contiguous()
    _down_weighted_kernel[(num_blocks * triton.cdiv(hidden_size, config.block_n),)](
        hidden,
        down_proj,
        per_pair,
        routing_weights,
        sorted_pair_ids,
        block_expert_ids,
        num_padded,
        num_pairs,
        num_blocks,
        hidden_size,
        intermediate,
        *hidden.stride(),
        *down_proj.stride(),
        *per_pair.stride(),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        DOT_PRECISION=precision,
        **launch,
    )
    return (
        per_pair.view(num_tokens, top_k, hidden_size).sum(dim=1, dtype=torch.float32).to(hidden_states.dtype)
    )
