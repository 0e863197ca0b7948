"""fused_moe_reference against the stock transformers experts (eager and grouped_mm) it must equal."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from transformers import Qwen2MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

from layerswap.kernels import torch_moe as reference
from layerswap.kernels.torch_moe import fused_moe_reference

HIDDEN, INTERMEDIATE = 64, 48


def make_experts(
    num_experts: int = 8, top_k: int = 2, hidden_act: str = "silu", seed: int = 0
) -> Qwen2MoeExperts:
    torch.manual_seed(seed)
    config = Qwen2MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        hidden_act=hidden_act,
    )
    experts = Qwen2MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    return experts


def make_routing(
    num_tokens: int, num_experts: int, top_k: int, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=generator).softmax(-1)
    return index.reshape(num_tokens, top_k), weights


def stock(experts: Qwen2MoeExperts, implementation: str, *args: torch.Tensor) -> torch.Tensor:
    experts.config._experts_implementation = implementation  # the module's own config, built per test
    return experts(*args)


def ours(experts: Qwen2MoeExperts, *args: torch.Tensor, **kwargs) -> torch.Tensor:
    return fused_moe_reference(args[0], experts.gate_up_proj, experts.down_proj, *args[1:], **kwargs)


# T=1: decode; T=3 with 8 experts: every expert has <= 3 rows, the row-major path; T=40 and T=257:
# 10-64 rows per expert, the weight-major path, and T=257 is prime so the slices are uneven.
@pytest.mark.parametrize("num_tokens", [1, 3, 40, 257])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_matches_stock_fp32(num_tokens: int, implementation: str) -> None:
    experts = make_experts()
    x = torch.randn(num_tokens, HIDDEN)
    index, weights = make_routing(num_tokens, 8, 2)
    with torch.no_grad():
        expected = stock(experts, implementation, x, index, weights)
        got = ours(experts, x, index, weights)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# Forces each engine at a row count / weight size where another would be chosen, so that all of them are
# checked against stock: x @ W.T per expert (MKL), torch's grouped GEMM (the 1-3 row regime), W @ x.T (MKL),
# and W @ x.T (oneDNN, used for large weights only).
@pytest.mark.parametrize(
    "min_rows, grouped, mkldnn_min_numel",
    [
        (10**9, False, 0),
        pytest.param(
            10**9,
            True,
            0,
            marks=pytest.mark.skipif(
                not reference._CPU_GROUPED_MM, reason="this torch has no CPU grouped GEMM"
            ),
        ),
        (1, False, 10**12),
        pytest.param(
            1,
            False,
            0,
            marks=pytest.mark.skipif(
                not reference._HAS_MKLDNN, reason="this torch build has no oneDNN linear"
            ),
        ),
    ],
    ids=["row_major_mkl", "grouped_gemm", "weight_major_mkl", "weight_major_onednn"],
)
def test_each_engine_matches_stock(
    monkeypatch: pytest.MonkeyPatch, min_rows: int, grouped: bool, mkldnn_min_numel: int
) -> None:
    monkeypatch.setattr(reference, "_FP32_WEIGHT_MAJOR_MIN_ROWS", min_rows)
    monkeypatch.setattr(reference, "_CPU_GROUPED_MM", grouped)
    monkeypatch.setattr(reference, "_MKLDNN_MIN_WEIGHT_NUMEL", mkldnn_min_numel)
    experts = make_experts()
    x = torch.randn(37, HIDDEN)
    index, weights = make_routing(37, 8, 2)
    with torch.no_grad():
        torch.testing.assert_close(
            ours(experts, x, index, weights), stock(experts, "eager", x, index, weights), atol=1e-5, rtol=1e-5
        )


# Some experts with 1-3 rows (grouped GEMM on gathered rows) and others with more (per-expert loop) in one
# call, plus an expert-parallel sentinel tail: the two paths must write disjoint rows and leave none unset.
def test_mixed_regimes_in_one_call() -> None:
    experts = make_experts()
    index = torch.tensor([[0, 1]] * 9 + [[2, 3], [4, 8]])  # experts 0, 1: 9 rows; 2, 3, 4: 1 row; 8: sentinel
    weights = torch.rand(11, 2)
    x = torch.randn(11, HIDDEN)
    with torch.no_grad():
        got = ours(experts, x, index, weights)
        valid = index < 8
        expected = stock(experts, "eager", x, index.clamp(max=7), weights * valid)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# bf16: the reference multiplies the routing weights and sums over top_k in fp32, stock in bf16, so they
# differ by bf16 rounding of the output, not more.
def test_matches_stock_bf16() -> None:
    experts = make_experts().to(torch.bfloat16)
    x = torch.randn(33, HIDDEN, dtype=torch.bfloat16)
    index, weights = make_routing(33, 8, 2)
    with torch.no_grad():
        expected = stock(experts, "grouped_mm", x, index, weights.bfloat16())
        got = ours(experts, x, index, weights.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_activations_match_stock(hidden_act: str) -> None:
    experts = make_experts(hidden_act=hidden_act)
    x = torch.randn(20, HIDDEN)
    index, weights = make_routing(20, 8, 2)
    with torch.no_grad():
        torch.testing.assert_close(
            ours(experts, x, index, weights, activation=hidden_act),
            stock(experts, "eager", x, index, weights),
            atol=1e-5,
            rtol=1e-5,
        )


# A callable is used as is: families whose act_fn is not an ACT2FN name still get the fast path.
def test_callable_activation() -> None:
    experts = make_experts(hidden_act="gelu_new")
    x = torch.randn(9, HIDDEN)
    index, weights = make_routing(9, 8, 2)
    with torch.no_grad():
        torch.testing.assert_close(
            ours(experts, x, index, weights, activation=experts.act_fn),
            stock(experts, "eager", x, index, weights),
            atol=1e-5,
            rtol=1e-5,
        )


# Training through the reference must give the stock gradients (the oneDNN engine has no autograd and is
# skipped then), for the inputs, both weights and the routing weights.
def test_gradients_match_stock() -> None:
    experts = make_experts()
    x = torch.randn(30, HIDDEN, requires_grad=True)
    index, weights = make_routing(30, 8, 2)
    weights.requires_grad_(True)
    grad_out = torch.randn(30, HIDDEN)
    tensors = (x, weights, experts.gate_up_proj, experts.down_proj)

    (ours(experts, x, index, weights) * grad_out).sum().backward()
    got = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    (stock(experts, "eager", x, index, weights) * grad_out).sum().backward()
    for mine, theirs in zip(got, (t.grad for t in tensors), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


# Expert-parallel sentinels (ids >= E) add nothing, as in stock grouped_mm where their weights are zero.
def test_sentinel_ids_contribute_nothing() -> None:
    experts = make_experts()
    x = torch.randn(6, HIDDEN)
    index, weights = make_routing(6, 8, 2)
    with torch.no_grad():
        expected = ours(experts, x, index[:, :1], weights[:, :1])
        index[:, 1] = 8
        got = ours(experts, x, index, weights)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


# A batch can be empty (e.g. one rank of a split batch); the output is an empty [0, H].
def test_no_tokens() -> None:
    experts = make_experts()
    index = torch.zeros(0, 2, dtype=torch.long)
    with torch.no_grad():
        out = ours(experts, torch.zeros(0, HIDDEN), index, torch.zeros(0, 2))
    assert out.shape == (0, HIDDEN)


# Strided hidden states (a slice of a wider buffer) and a transposed-then-back weight view: no assumption
# that inputs are contiguous.
def test_non_contiguous_inputs() -> None:
    experts = make_experts()
    wide = torch.randn(17, 2 * HIDDEN)
    x = wide[:, ::2]
    gate_up = experts.gate_up_proj.detach().transpose(1, 2).contiguous().transpose(1, 2)
    index, weights = make_routing(17, 8, 2)
    with torch.no_grad():
        expected = stock(experts, "eager", x.contiguous(), index, weights)
        got = fused_moe_reference(x, gate_up, experts.down_proj, index, weights)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_unknown_activation_is_refused() -> None:
    experts = make_experts()
    index, weights = make_routing(2, 8, 2)
    with pytest.raises(ValueError, match="unknown activation 'swiglu'"):
        ours(experts, torch.randn(2, HIDDEN), index, weights, activation="swiglu")


# Autocast can hand fp32 activations to bf16 weights: computed in the weights' dtype, returned in the input's.
def test_activations_in_another_dtype_than_weights() -> None:
    experts = make_experts().to(torch.bfloat16)
    x = torch.randn(12, HIDDEN)
    index, weights = make_routing(12, 8, 2)
    with torch.no_grad():
        got = ours(experts, x, index, weights)
        expected = ours(experts, x.bfloat16(), index, weights)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected.float(), atol=1e-2, rtol=1e-2)


# layerswap.kernels must import, and its torch backend run, where triton is not installed (CPU-only
# installs): triton is hidden in a fresh interpreter, as importlib and `import` would see a missing package.
def test_kernels_work_without_triton() -> None:
    script = textwrap.dedent("""
        import importlib.abc, importlib.util, sys
        real_find_spec = importlib.util.find_spec
        importlib.util.find_spec = lambda n, *a, **k: None if n.split(".")[0] == "triton" else real_find_spec(n, *a, **k)
        class NoTriton(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] == "triton":
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, NoTriton())
        import torch
        from layerswap.kernels import KernelInputError, fused_moe
        args = (torch.randn(3, 32), torch.randn(4, 32, 32), torch.randn(4, 32, 16), torch.randint(0, 4, (3, 2)),
                torch.rand(3, 2))
        assert fused_moe(*args).shape == (3, 32)
        try:
            fused_moe(*args, backend="triton")
        except KernelInputError as error:
            assert "needs the triton package" in str(error), error
        else:
            raise AssertionError("backend='triton' without triton must raise")
        assert "triton" not in sys.modules
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]


# Experts held as three separate projections (-quant's nn.Linear experts): every engine against what the three
# nn.Linear calls compute ("row" is exactly that). 1 row: the GEMV; 5 and 40: uneven skinny GEMMs.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("op", reference.LINEAR_EXPERT_OPS)
@pytest.mark.parametrize("has_gate", [True, False], ids=["gated", "no_gate"])
def test_each_linear_expert_engine_matches_nn_linear(
    op: str, rows: int, dtype: torch.dtype, has_gate: bool
) -> None:
    generator = torch.Generator().manual_seed(rows)
    hidden, intermediate = 64, 48
    gate, up, down = (
        nn.Linear(hidden, intermediate, bias=False),
        nn.Linear(hidden, intermediate, bias=False),
        nn.Linear(intermediate, hidden, bias=False),
    )
    x = torch.randn(rows, hidden, generator=generator).to(dtype)
    act = torch.nn.functional.silu
    with torch.no_grad():
        for linear in (gate, up, down):
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * 0.2)
            linear.to(dtype)
        want = down(act(gate(x)) * up(x)) if has_gate else down(act(up(x)))
        got = reference.linear_expert_mlp(
            x, gate.weight if has_gate else None, up.weight, down.weight, act, op
        )
    assert got.shape == want.shape and got.dtype == dtype
    if op == "row" or (op == "mv" and rows > 1):  # nn.Linear's own computation (mv takes one row only)
        assert torch.equal(got, want)
    else:
        tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


# Real fp32 projections (>= 1M elements) take oneDNN's weight-major GEMM, which small test weights never reach.
def test_weight_major_linear_expert_on_onednn_sized_weights() -> None:
    generator = torch.Generator().manual_seed(0)
    hidden, intermediate = 1024, 1024
    gate, up = (torch.randn(intermediate, hidden, generator=generator) * 0.03 for _ in range(2))
    down = torch.randn(hidden, intermediate, generator=generator) * 0.03
    x = torch.randn(5, hidden, generator=generator)
    act = torch.nn.functional.silu
    assert gate.numel() >= reference._MKLDNN_MIN_WEIGHT_NUMEL
    with torch.no_grad():
        want = reference.linear_expert_mlp(x, gate, up, down, act, "row")
        got = reference.linear_expert_mlp(x, gate, up, down, act, "wm")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# Engine "skinny" computes a SiLU MLP whole in layerswap's kernel; any other activation (or a SiLU something
# could observe) runs the kernel's two GEMMs with the activation in torch between them.
def test_what_counts_as_plain_silu() -> None:
    from transformers.activations import ACT2FN

    hooked = torch.nn.SiLU()
    hooked.register_forward_hook(lambda *args: None)
    own_forward = torch.nn.SiLU()
    own_forward.forward = lambda x: x
    assert reference._is_silu(torch.nn.functional.silu)
    assert reference._is_silu(torch.nn.SiLU()) and reference._is_silu(ACT2FN["silu"])
    assert not reference._is_silu(ACT2FN["gelu"]) and not reference._is_silu(torch.nn.functional.gelu)
    assert not reference._is_silu(hooked) and not reference._is_silu(own_forward)


@pytest.mark.parametrize("activation", ["gelu_pytorch_tanh", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_skinny_engine_with_any_activation(activation: str, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(7)
    rows = torch.randn(3, 64, generator=generator).to(dtype)
    gate_up = (torch.randn(96, 64, generator=generator) * 0.2).to(dtype)
    down = (torch.randn(64, 48, generator=generator) * 0.2).to(dtype)
    act = reference.resolve_activation(activation)
    with torch.no_grad():
        got = reference._expert_mlp(rows, gate_up, down, act, out=torch.empty_like(rows), op="skinny")
        want = reference._expert_mlp(rows, gate_up, down, act, out=torch.empty_like(rows), op="row")
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


# The no-grad weighting runs through one small reused buffer, chunk by chunk: the same sums, in the same order,
# as weighting every pair's output at once (a chunk of 3 rows here: chunks end inside one token's pairs).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunked_weighting_is_the_whole_weighting(dtype: torch.dtype, monkeypatch) -> None:
    experts = make_experts().to(dtype)
    x = torch.randn(37, HIDDEN).to(dtype)
    index, weights = make_routing(37, 8, 2)
    args = (x, experts.gate_up_proj, experts.down_proj, index, weights.to(dtype))
    with torch.no_grad():
        whole = fused_moe_reference(*args)
        monkeypatch.setattr(reference, "_WEIGHTED_CHUNK_BYTES", 3 * 4 * HIDDEN)
        chunked = fused_moe_reference(*args)
    assert torch.equal(chunked, whole)
