"""The Triton fused-MoE kernels against the plain PyTorch reference.

Without a GPU they run in Triton's interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET=1 first), so
shapes stay tiny. bf16 runs only on CUDA: the interpreter's bf16 tl.dot is wrong.
"""

from __future__ import annotations

import pytest
import torch

from layerswap.kernels import KernelInputError, TileConfig, fused_moe, fused_moe_reference

triton = pytest.importorskip("triton")
from layerswap.kernels import triton_moe as kernels  # noqa: E402
from layerswap.kernels.configs import get_tile_config  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and not isinstance(kernels._gate_up_act_kernel, triton.runtime.interpreter.InterpretedFunction):
    pytest.skip(
        "the kernels were compiled before TRITON_INTERPRET=1 was set; run this file on its own",
        allow_module_level=True,
    )

BF16_ON_CUDA_ONLY = pytest.mark.skipif(
    not CUDA, reason="bf16 tl.dot is wrong in the Triton interpreter; run benchmarks/gpu_check.sh on a GPU"
)
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=BF16_ON_CUDA_ONLY)]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def make_weights(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) * 0.2
    down = torch.randn(num_experts, hidden, intermediate, generator=generator) * 0.2
    return gate_up.to(DEVICE, dtype), down.to(DEVICE, dtype)


def make_routing(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=generator)
    return index.reshape(num_tokens, top_k).to(DEVICE), weights.to(DEVICE, dtype)


def check(x, gate_up, down, index, weights, activation="silu", config=None) -> None:
    """Triton output vs the reference computed in fp32 from the same (already rounded) inputs."""
    with torch.no_grad():
        if config is None:
            got = fused_moe(x, gate_up, down, index, weights, activation=activation, backend="triton")
        else:
            got = kernels.fused_moe_triton(x, gate_up, down, index, weights, activation, config)
        expected = fused_moe_reference(
            x.float().cpu(),
            gate_up.float().cpu(),
            down.float().cpu(),
            index.cpu(),
            weights.float().cpu(),
            activation=activation,
        )
    assert got.dtype == x.dtype and got.shape == x.shape
    tolerance = TOLERANCE[gate_up.dtype]
    torch.testing.assert_close(got.float().cpu(), expected, atol=tolerance, rtol=tolerance)


# (num_tokens, num_experts, top_k), each with why it is here.
SHAPES = {
    "one_token": (1, 4, 2),  # decode: every active expert has one row and BLOCK_M - 1 padding rows
    "tokens_below_block_m": (5, 6, 2),  # T < BLOCK_M: a single, partly padded block per expert
    "prime_experts": (23, 7, 3),  # E = 7: no power-of-two assumption on the expert count or block table
    "top_k_1": (12, 6, 1),  # K = 1: token of a pair is the pair id itself
    "top_k_equals_experts": (9, 5, 5),  # K = E: every token visits every expert
    "large_t": (300, 5, 2),  # 600 pairs: several full blocks per expert, the larger-T tile config
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_matches_reference(shape: str, dtype: torch.dtype) -> None:
    num_tokens, num_experts, top_k = SHAPES[shape]
    gate_up, down = make_weights(num_experts, 32, 16, dtype)
    index, weights = make_routing(num_tokens, num_experts, top_k, dtype)
    check(torch.randn(num_tokens, 32, device=DEVICE, dtype=dtype), gate_up, down, index, weights)


# All pairs in one expert: one long run of blocks, every other expert empty (a skewed router).
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_tokens_to_one_expert(dtype: torch.dtype) -> None:
    gate_up, down = make_weights(4, 32, 16, dtype)
    index = torch.full((40, 1), 2, device=DEVICE)
    weights = torch.rand(40, 1, device=DEVICE, dtype=dtype)
    check(torch.randn(40, 32, device=DEVICE, dtype=dtype), gate_up, down, index, weights)


# Experts 1-4 and 6-7 get no token: zero-length runs must neither get a block nor shift the others.
@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_without_tokens(dtype: torch.dtype) -> None:
    gate_up, down = make_weights(8, 32, 16, dtype)
    index = torch.tensor([[0, 5], [5, 0], [0, 5], [5, 0], [0, 5]], device=DEVICE)
    weights = torch.rand(5, 2, device=DEVICE, dtype=dtype)
    check(torch.randn(5, 32, device=DEVICE, dtype=dtype), gate_up, down, index, weights)


# Strided hidden states and a non-contiguous weight view: the kernels read through strides, no copies.
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(dtype: torch.dtype) -> None:
    gate_up, down = make_weights(5, 32, 16, dtype)
    gate_up = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    x = torch.randn(7, 64, device=DEVICE, dtype=dtype)[:, ::2]
    index, weights = make_routing(7, 5, 2, dtype)
    check(x, gate_up, down, index, weights.t().contiguous().t())


# H and I not multiples of BLOCK_K / BLOCK_N, several K iterations and column tiles: the k- and n-masks.
# 5 row blocks in launch groups of 2: the last group is partial, which the grouped pid mapping must handle.
@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_dims_k_loop_and_launch_groups(dtype: torch.dtype) -> None:
    gate_up, down = make_weights(3, 40, 24, dtype)
    index, weights = make_routing(13, 3, 2, dtype)
    config = TileConfig(block_m=16, block_n=16, block_k=16, group_m=2)
    check(torch.randn(13, 40, device=DEVICE, dtype=dtype), gate_up, down, index, weights, config=config)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_pytorch_tanh", "relu"])
def test_activations(activation: str) -> None:
    gate_up, down = make_weights(4, 32, 16, torch.float32)
    index, weights = make_routing(6, 4, 2, torch.float32)
    check(torch.randn(6, 32, device=DEVICE), gate_up, down, index, weights, activation=activation)


# Expert-parallel sentinel ids (>= E) add nothing, as in the reference and stock grouped_mm.
def test_sentinel_ids_contribute_nothing() -> None:
    gate_up, down = make_weights(4, 32, 16, torch.float32)
    index, weights = make_routing(6, 4, 2, torch.float32)
    index[:, 1] = 4
    check(torch.randn(6, 32, device=DEVICE), gate_up, down, index, weights)


# Autocast can hand fp32 activations to fp16 weights: computed in the weights' dtype, returned in the input's.
def test_activations_in_another_dtype_than_weights() -> None:
    gate_up, down = make_weights(4, 32, 16, torch.float16)
    index, weights = make_routing(6, 4, 2, torch.float32)
    x = torch.randn(6, 32, device=DEVICE)
    with torch.no_grad():
        got = fused_moe(x, gate_up, down, index, weights, backend="triton")
        expected = fused_moe_reference(
            x.half().float().cpu(), gate_up.float().cpu(), down.float().cpu(), index.cpu(), weights.cpu()
        )
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), expected, atol=1e-2, rtol=1e-2)


def test_align_routing_blocks() -> None:
    index = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 7]])  # expert 2 empty, 7 is a sentinel for E = 4
    sorted_ids, block_experts, num_padded = kernels.align_routing(index, num_experts=4, block_m=16)
    flat = index.reshape(-1)
    assert int(num_padded) == 3 * 16  # experts 0, 1, 3 get one block each
    real = sorted_ids[: int(num_padded)]
    for block, expert in enumerate(block_experts[:3].tolist()):
        pairs = real[block * 16 : (block + 1) * 16]
        pairs = pairs[pairs < flat.numel()]
        assert (flat[pairs.long()] == expert).all()
    assert sorted(real[real < flat.numel()].tolist()) == [i for i in range(8) if flat[i] < 4]
    assert (block_experts[3:] == 4).all()  # blocks past the end carry E, and exit at once


# No host sync: on the meta device no tensor has values, so any .item(), data-dependent shape (nonzero,
# bincount without a static size) or Python branch on a value would raise here.
def test_align_routing_has_no_host_sync() -> None:
    index = torch.empty(33, 4, dtype=torch.long, device="meta")
    sorted_ids, block_experts, num_padded = kernels.align_routing(index, num_experts=60, block_m=16)
    bound = triton.cdiv(33 * 4 + 60 * 15, 16) * 16
    assert sorted_ids.shape == (bound,) and block_experts.shape == (bound // 16,) and num_padded.shape == (1,)


@pytest.mark.skipif(not CUDA, reason="a CUDA sync check needs a GPU; the meta-device test covers CPU")
def test_no_host_sync_and_cuda_graph_capture() -> None:
    gate_up, down = make_weights(8, 64, 32, torch.bfloat16)
    index, weights = make_routing(16, 8, 2, torch.bfloat16)
    x = torch.randn(16, 64, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = fused_moe(x, gate_up, down, index, weights)  # compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fused_moe(x, gate_up, down, index, weights)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fused_moe(x, gate_up, down, index, weights)
        graph.replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager)


def test_default_tile_config_is_decode_sized() -> None:
    assert get_tile_config(60, 1408, "cpu-interpreter", 1).block_m == 16
    assert get_tile_config(60, 1408, "cpu-interpreter", 4096).block_m == 128


@pytest.mark.parametrize(
    "field, value", [("block_m", 8), ("block_k", 48), ("group_m", 0), ("num_warps", 3), ("num_stages", 0)]
)
def test_tile_config_is_validated(field: str, value: int) -> None:
    settings = {"block_m": 16, "block_n": 16, "block_k": 16, field: value}
    with pytest.raises(KernelInputError, match=field):
        TileConfig(**settings)


# fullgraph=True proves the custom op hides the torch backend's data-dependent expert loop from dynamo;
# aot_eager runs dynamo and AOT tracing with the fake kernel, without inductor's C++ build time.
def test_torch_compile_fullgraph_on_cpu() -> None:
    torch._dynamo.reset()
    gate_up, down = make_weights(5, 32, 16, torch.float32)
    gate_up, down = gate_up.cpu(), down.cpu()
    index, weights = make_routing(9, 5, 2, torch.float32)
    index, weights = index.cpu(), weights.cpu()
    x = torch.randn(9, 32)

    def layer(x, index, weights):
        return fused_moe(x * 2.0, gate_up, down, index, weights, backend="torch") + x

    try:
        with torch.no_grad():
            compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, index, weights)
            eager = layer(x, index, weights)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager)


# The registered op itself (eager calls bypass it; torch.compile uses it): schema, fake kernel and AOT
# dispatch checked by torch.library.opcheck, for both backends.
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_custom_op_passes_opcheck(backend: str) -> None:
    gate_up, down = make_weights(5, 32, 16, torch.float32)
    index, weights = make_routing(9, 5, 2, torch.float32)
    x = torch.randn(9, 32, device=DEVICE)
    torch.library.opcheck(
        torch.ops.layerswap.fused_moe.default, (x, gate_up, down, index, weights, "silu", backend)
    )
    torch.testing.assert_close(
        torch.ops.layerswap.fused_moe(x, gate_up, down, index, weights, "silu", backend),
        fused_moe(x, gate_up, down, index, weights, backend=backend),
    )


def test_backend_choice_and_errors() -> None:
    gate_up, down = make_weights(4, 32, 16, torch.float32)
    index, weights = make_routing(3, 4, 2, torch.float32)
    x = torch.randn(3, 32, device=DEVICE)
    with pytest.raises(KernelInputError, match="named activations only"):
        fused_moe(x, gate_up, down, index, weights, activation=torch.tanh, backend="triton")
    with pytest.raises(KernelInputError, match="backend must be"):
        fused_moe(x, gate_up, down, index, weights, backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(KernelInputError, match=r"down_proj must be \[E, H, I\]"):
        fused_moe(x, gate_up, down.transpose(1, 2), index, weights)
    # No backend given and a callable: the torch path, on any device.
    torch.testing.assert_close(
        fused_moe(x, gate_up, down, index, weights, activation=torch.nn.functional.silu),
        fused_moe(x, gate_up, down, index, weights, activation="silu", backend="torch"),
    )
