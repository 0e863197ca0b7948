"""The CPU dispatch of fused_moe: every strategy's numerics (forced, whatever this machine would pick), the
calibration's decisions, and the on-disk cache (keyed, atomic, read-only fallback, opt-out). No timing asserts."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time

import pytest
import torch

from layerswap.kernels import (
    Plan,
    _workers,
    cpu_dispatch,
    cpu_native,
    fused_moe,
    fused_moe_reference,
    torch_moe,
)
from layerswap.kernels import _cpu_strategies as strategies
from layerswap.kernels.cpu_dispatch import CpuInfo
from layerswap.kernels.torch_moe import EXPERT_OPS, ROW_CLASSES, resolve_activation

# Against the fp32 reference: stock rounds every intermediate to the weights' dtype, so bf16 (8 mantissa bits)
# differs by a few units in the last place of outputs of magnitude 1-5; fp16 keeps 11 bits.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}
HIDDEN, INTERMEDIATE = 64, 48

# Every strategy with the parameters that reach each of its branches.
PLANS = {
    "stock": Plan("stock"),
    "layerswap": Plan("layerswap"),
    # Each engine for every row count, and a mix (calibrated plans mix them: T=40 gives classes 2-4).
    **{f"layerswap_{op}": Plan("layerswap", ops=(op,) * ROW_CLASSES) for op in EXPERT_OPS},
    "layerswap_mixed": Plan("layerswap", ops=("mv", "grouped", "row", "wm", "grouped", "row", "wm")),
    # The same on two single-threaded worker threads, each taking whole experts.
    "layerswap_mixed_workers": Plan(
        "layerswap", ops=("mv", "grouped", "row", "wm", "grouped", "row", "wm"), workers=2
    ),
    "layerswap_grouped_workers": Plan("layerswap", ops=("grouped",) * ROW_CLASSES, workers=3),
    # layerswap's kernel (bf16; other dtypes run it as "wm") from single-threaded workers and mixed with others.
    "layerswap_skinny_workers": Plan("layerswap", ops=("skinny",) * ROW_CLASSES, workers=2),
    "layerswap_skinny_mixed": Plan("layerswap", ops=("skinny", "skinny", "skinny", "wm", "row", "wm", "wm")),
    "upcast": Plan("upcast"),  # default min_rows: the T below mix converted and direct experts
    "upcast_all_converted": Plan("upcast", min_rows=1),  # one-row experts converted too
    "upcast_none_converted": Plan("upcast", min_rows=10**6),  # every expert through torch's own GEMM
    "upcast_small_blocks": Plan("upcast", min_rows=1, block_bytes=4096),  # many conversion blocks per weight
}


@pytest.fixture
def calibrating(tmp_path, monkeypatch):
    """Calibration on, cached under tmp_path, nothing forced, nothing remembered from other tests."""
    monkeypatch.setenv(cpu_dispatch.ENV_CALIBRATION, "1")
    monkeypatch.setenv(cpu_dispatch.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(cpu_dispatch.ENV_STRATEGY, raising=False)
    monkeypatch.setattr(cpu_dispatch, "_machine_busy", lambda: False)  # other tests running alongside
    cpu_dispatch.clear_memory_cache()
    yield tmp_path
    cpu_dispatch.clear_memory_cache()


def make_problem(num_tokens, num_experts=8, top_k=2, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN, generator=generator) * 0.2).to(dtype)
    down = (torch.randn(num_experts, HIDDEN, INTERMEDIATE, generator=generator) * 0.2).to(dtype)
    x = torch.randn(num_tokens, HIDDEN, generator=generator).to(dtype)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    index = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, generator=generator).to(dtype)
    return x, gate_up, down, index, weights


def expected(x, gate_up, down, index, weights, activation="silu"):
    """fp32 reference from the same (already rounded) inputs."""
    return fused_moe_reference(
        x.float(), gate_up.float(), down.float(), index, weights.float(), activation=activation
    )


def run(plan: Plan, x, gate_up, down, index, weights, activation="silu"):
    with torch.no_grad():
        return strategies.STRATEGIES[plan.strategy](
            x, gate_up, down, index, weights, resolve_activation(activation), plan
        )


def check(got, want, dtype):
    # Absolute tolerance relative to the output's scale: top_k = E sums five rounded expert outputs of up to ~5.
    tolerance = TOLERANCE[dtype]
    scale = max(want.abs().max().item(), 1.0)
    torch.testing.assert_close(got.float(), want, atol=tolerance * scale, rtol=tolerance)


# T=1: decode, one row per expert; T=5: 1-3 rows per expert (the direct side of upcast); T=40 and prime T=97:
# 10-25 rows per expert, converted, uneven slices.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 5, 40, 97])
@pytest.mark.parametrize("plan", list(PLANS))
def test_each_strategy_matches_the_reference(plan: str, num_tokens: int, dtype: torch.dtype) -> None:
    problem = make_problem(num_tokens, dtype=dtype)
    got = run(PLANS[plan], *problem)
    assert got.dtype == dtype and got.shape == (num_tokens, HIDDEN)
    check(got, expected(*problem), dtype)


# A plan's worker threads are used: each worker runs whole experts on one thread, the caller none of them.
@pytest.mark.parametrize(
    "plan", ["layerswap_mixed_workers", "layerswap_grouped_workers", "layerswap_skinny_workers"]
)
def test_a_plans_workers_run_its_experts(plan: str, monkeypatch) -> None:
    splits = []
    real_run_split = _workers.run_split

    def spy(work, groups, workers):
        splits.append((sorted(e for group in groups for e in group), workers))
        return real_run_split(work, groups, workers)

    monkeypatch.setattr(_workers, "run_split", spy)
    problem = make_problem(40, dtype=torch.bfloat16)
    check(run(PLANS[plan], *problem), expected(*problem), torch.bfloat16)
    active = sorted(problem[3].unique().tolist())
    assert splits == [(active, PLANS[plan].workers)]


# One call with experts on both sides of min_rows (9 rows; 1 row), an expert with no rows, and expert-parallel
# sentinels (ids >= E), which must add nothing, in every strategy.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("plan", list(PLANS))
def test_mixed_rows_sentinels_and_idle_experts(plan: str, dtype: torch.dtype) -> None:
    _, gate_up, down, _, _ = make_problem(1, dtype=dtype)
    index = torch.tensor(
        [[0, 1]] * 9 + [[2, 3], [4, 8]]
    )  # experts 0, 1: 9 rows; 2-4: 1; 5-7: none; 8: sentinel
    weights = torch.rand(11, 2).to(dtype)
    x = torch.randn(11, HIDDEN).to(dtype)
    got = run(PLANS[plan], x, gate_up, down, index, weights)
    valid = index < 8
    want = expected(x, gate_up, down, index.clamp(max=7), weights * valid)
    check(got, want, dtype)


# top_k == E (every token visits every expert) and all tokens to one expert (one large group).
@pytest.mark.parametrize("plan", list(PLANS))
def test_top_k_equals_experts_and_one_busy_expert(plan: str) -> None:
    x, gate_up, down, _, _ = make_problem(6, num_experts=5, dtype=torch.bfloat16)
    index = torch.arange(5).repeat(6, 1)
    weights = torch.rand(6, 5).bfloat16()
    check(
        run(PLANS[plan], x, gate_up, down, index, weights),
        expected(x, gate_up, down, index, weights),
        torch.bfloat16,
    )
    index = torch.zeros(30, 1, dtype=torch.long)
    x30 = torch.randn(30, HIDDEN).bfloat16()
    weights = torch.rand(30, 1).bfloat16()
    check(
        run(PLANS[plan], x30, gate_up, down, index, weights),
        expected(x30, gate_up, down, index, weights),
        torch.bfloat16,
    )


@pytest.mark.parametrize("activation", ["gelu", "gelu_pytorch_tanh", "relu"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_activations(plan: str, activation: str) -> None:
    problem = make_problem(20, dtype=torch.bfloat16)
    check(
        run(PLANS[plan], *problem, activation=activation),
        expected(*problem, activation=activation),
        torch.bfloat16,
    )


# Autocast can hand fp32 activations to bf16 weights: computed in the weights' dtype, returned in the input's.
@pytest.mark.parametrize("plan", list(PLANS))
def test_activations_in_another_dtype_than_weights(plan: str) -> None:
    x, gate_up, down, index, weights = make_problem(12, dtype=torch.bfloat16)
    got = run(PLANS[plan], x.float(), gate_up, down, index, weights)
    assert got.dtype == torch.float32
    check(got, expected(x, gate_up, down, index, weights), torch.bfloat16)


# The forced strategy runs through the public entry point, callables included, and T=0 returns an empty [0, H].
@pytest.mark.parametrize(
    "name", ["stock", "layerswap", "layerswap:row", "layerswap:wm", "upcast", "upcast:1"]
)
def test_forced_strategy_through_fused_moe(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(cpu_dispatch.ENV_STRATEGY, name)
    problem = make_problem(33, dtype=torch.bfloat16)
    with torch.no_grad():
        check(fused_moe(*problem), expected(*problem), torch.bfloat16)
        check(fused_moe(*problem, activation=torch.nn.functional.silu), expected(*problem), torch.bfloat16)
        empty = fused_moe(problem[0][:0], problem[1], problem[2], problem[3][:0], problem[4][:0])
    assert empty.shape == (0, HIDDEN)
    assert cpu_dispatch.plan_for(problem[0], problem[1], problem[2], problem[3]).source == "forced"


@pytest.mark.parametrize(
    "text", ["magic", "layerswap:fastest", "layerswap:row:0", "layerswap:row:many", "stock:2", "upcast:many"]
)
def test_an_unknown_forced_strategy_is_refused(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(cpu_dispatch.ENV_STRATEGY, text)
    problem = make_problem(3)
    with pytest.raises(ValueError, match=rf"LAYERSWAP_CPU_STRATEGY='{text}'.*expected one of"):
        cpu_dispatch.plan_for(problem[0], problem[1], problem[2], problem[3])


# The capability rules used without calibration: layerswap's own path where oneDNN has the dtype in hardware
# (and for fp32), weights converted to fp32 on an AVX2-only CPU.
def test_rules_follow_the_cpu() -> None:
    avx2 = CpuInfo("AMD EPYC", ("avx2", "fma"), "AVX2", 2)
    amx = CpuInfo("Intel Xeon", ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"), "AVX512", 2)
    assert cpu_dispatch.rule_plan(torch.bfloat16, avx2).strategy == "upcast"
    assert cpu_dispatch.rule_plan(torch.float16, avx2).strategy == "upcast"
    assert cpu_dispatch.rule_plan(torch.float32, avx2).strategy == "layerswap"
    assert cpu_dispatch.rule_plan(torch.bfloat16, amx).strategy == "layerswap"
    assert "avx512_bf16" in amx.summary() and "2 cores" in avx2.summary()


def test_cpu_info_reads_this_machine() -> None:
    info = cpu_dispatch.cpu_info()
    assert info.model and info.logical_cores >= 1
    assert set(info.flags) <= set(cpu_dispatch._FLAGS_THAT_MATTER)
    assert info.capability == torch.backends.cpu.get_cpu_capability()


_AMX_FLAGS = {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize(
    "variable, cap, kept",
    [
        ("ONEDNN_MAX_CPU_ISA", "AVX2", {"avx2", "fma"}),
        ("ONEDNN_MAX_CPU_ISA", "avx512_core", {"avx2", "fma", "avx512f"}),
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", _AMX_FLAGS - {"amx_tile", "amx_bf16"}),
        ("DNNL_MAX_CPU_ISA", "AVX2", {"avx2", "fma"}),  # the older name
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX", _AMX_FLAGS),
        ("ONEDNN_MAX_CPU_ISA", "ALL", _AMX_FLAGS),  # no cap
        ("ONEDNN_MAX_CPU_ISA", "NOT_AN_ISA", _AMX_FLAGS),  # oneDNN ignores it: so do we
    ],
)
def test_onednn_isa_cap_removes_the_flags_above_it(
    monkeypatch, variable: str, cap: str, kept: set[str]
) -> None:
    monkeypatch.setenv(variable, cap)
    assert cpu_dispatch._onednn_allowed(_AMX_FLAGS) == kept


def test_amx_cpu_capped_at_avx2_is_ruled_and_cached_as_one(monkeypatch, calibrating) -> None:
    """ONEDNN_MAX_CPU_ISA=AVX2 on an AMX Xeon makes oneDNN's bf16 GEMM 16x slower: the rule must see an AVX2
    CPU, and the cache must not hand a decision measured without the cap to a process with it."""
    monkeypatch.setattr(cpu_dispatch, "_read_proc_cpuinfo", lambda: ("Intel Xeon", set(_AMX_FLAGS)))
    for variable in cpu_dispatch.ISA_LIMIT_ENV:
        monkeypatch.delenv(variable, raising=False)
    cpu_dispatch.cpu_info.cache_clear()
    cpu_dispatch._machine_digest.cache_clear()
    try:
        assert cpu_dispatch.rule_plan(torch.bfloat16).strategy == "layerswap"
        assert cpu_dispatch.machine_key()["isa_limits"] == {}
        uncapped = cpu_dispatch.cache_path()
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
        cpu_dispatch.cpu_info.cache_clear()
        cpu_dispatch._machine_digest.cache_clear()
        assert not cpu_dispatch.cpu_info().amx and not cpu_dispatch.cpu_info().avx512_bf16
        assert cpu_dispatch.rule_plan(torch.bfloat16).strategy == "upcast"
        assert cpu_dispatch.machine_key()["isa_limits"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
        assert cpu_dispatch.cache_path() != uncapped
        # A cap oneDNN does not read still keys the cache: MKL's and ATen's caps change their engines too.
        monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
        cpu_dispatch._machine_digest.cache_clear()
        assert cpu_dispatch.machine_key()["isa_limits"]["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    finally:
        cpu_dispatch.cpu_info.cache_clear()
        cpu_dispatch._machine_digest.cache_clear()


@pytest.mark.parametrize(
    "num_tokens, bucket", [(1, 1), (2, 2), (3, 4), (16, 16), (17, 32), (512, 512), (10**6, 8192)]
)
def test_token_buckets(num_tokens: int, bucket: int) -> None:
    assert cpu_dispatch.token_bucket(num_tokens) == bucket


# --- calibration ---------------------------------------------------------------------------------------------


# What a "slow" strategy or engine adds to each call: far above what the real ones cost even on a loaded machine,
# where a 2-thread OpenMP region can wait a whole scheduler slice for a descheduled thread. At 3 ms these tests
# failed while other test runs shared the 2 cores; there the tiny test problems' real candidates took medians of
# up to 48-88 ms in some calibrations (1-3 ms otherwise).
SLOW_S = 0.05


def _slow(seconds: float, inner):
    def strategy(*args):
        time.sleep(seconds)
        return inner(*args)

    return strategy


# The calibration picks what is measurably faster, and stock unless something beats it by the margin.
@pytest.mark.parametrize("slow, chosen", [("layerswap", "stock"), ("stock", "layerswap")])
def test_calibration_picks_the_faster_strategy(calibrating, monkeypatch, slow: str, chosen: str) -> None:
    fake = dict(strategies.STRATEGIES)
    fake[slow] = _slow(SLOW_S, fake[slow])
    monkeypatch.setattr(cpu_dispatch, "STRATEGIES", fake)
    problem = make_problem(16)
    plan = cpu_dispatch.plan_for(problem[0], problem[1], problem[2], problem[3])
    assert (plan.strategy, plan.source) == (chosen, "calibrated")


# The per-row-count engines: what is measurably faster per class; the grouped GEMM unless beaten by the margin.
@pytest.mark.parametrize("slow", ["grouped", "row", "wm"])
def test_engine_measurement_avoids_a_slow_engine(calibrating, monkeypatch, slow: str) -> None:
    real = torch_moe._expert_mlp

    def expert_mlp(*args, op=None, **kwargs):
        if op == slow:
            time.sleep(SLOW_S)
        return real(*args, op=op, **kwargs)

    monkeypatch.setattr(torch_moe, "_expert_mlp", expert_mlp)
    if slow == "grouped":
        monkeypatch.setattr(
            torch_moe, "_gemv_experts_grouped", _slow(SLOW_S, torch_moe._gemv_experts_grouped)
        )
    _, gate_up, down, _, _ = make_problem(1)
    plan, medians = cpu_dispatch._engines_plan(gate_up, down, resolve_activation("silu"))
    assert plan.strategy == "layerswap" and len(plan.ops) == ROW_CLASSES
    assert slow not in plan.ops
    assert {name.partition("@")[0] for name in medians} == set(EXPERT_OPS)
    assert [name for name in medians if name.startswith("mv@")] == ["mv@1"]  # mv: one row only


# layerswap's kernel is a candidate at every row count of bf16 or fp32 (on an AVX2 Zen 3 it won at 32 rows), and
# loses to a faster engine; fp16 has no kernel.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_engine_measurement_times_the_kernel_at_every_row_count(calibrating, monkeypatch, dtype) -> None:
    assert cpu_native.available(), cpu_native.why_unavailable()
    real = torch_moe._expert_mlp

    # Every other engine a bit slower than the kernel, so that none drops it from the larger row counts.
    def expert_mlp(*args, op=None, **kwargs):
        if op != "skinny":
            time.sleep(0.002)
        return real(*args, op=op, **kwargs)

    monkeypatch.setattr(torch_moe, "_expert_mlp", expert_mlp)
    monkeypatch.setattr(torch_moe, "_gemv_experts_grouped", _slow(0.002, torch_moe._gemv_experts_grouped))
    _, gate_up, down, _, _ = make_problem(1, dtype=dtype)
    plan, medians = cpu_dispatch._engines_plan(gate_up, down, resolve_activation("silu"))
    every_count = [f"skinny@{m}" for m in cpu_dispatch._ENGINE_ROWS]
    assert every_count == [
        "skinny@1",
        "skinny@2",
        "skinny@4",
        "skinny@8",
        "skinny@23",
        "skinny@47",
        "skinny@95",
    ]
    if dtype in torch_moe.SKINNY_DTYPES:
        assert [name for name in medians if name.startswith("skinny@")] == every_count
        assert plan.ops == ("skinny",) * ROW_CLASSES
    else:
        assert not any(name.startswith("skinny@") for name in medians) and "skinny" not in plan.ops

    # Slower than the others, it loses at every row count.
    monkeypatch.setattr(torch_moe, "_expert_mlp", real)
    monkeypatch.setattr(torch_moe, "_skinny_experts", _slow(SLOW_S, torch_moe._skinny_experts))
    plan, _ = cpu_dispatch._engines_plan(gate_up, down, resolve_activation("silu"))
    assert "skinny" not in plan.ops


# Engines are timed on several experts a call, run as the layer runs them: the batched ones in one call.
def test_engine_measurement_runs_experts_as_the_layer_does(calibrating, monkeypatch) -> None:
    groups: dict[str, list[list[int]]] = {"grouped": [], "skinny": []}

    def recording(op, real):
        def run(*args):
            groups[op].append(list(args[5]) if op == "grouped" else list(args[3]))
            return real(*args)

        return run

    monkeypatch.setattr(
        torch_moe, "_gemv_experts_grouped", recording("grouped", torch_moe._gemv_experts_grouped)
    )
    monkeypatch.setattr(torch_moe, "_skinny_experts", recording("skinny", torch_moe._skinny_experts))
    _, gate_up, down, _, _ = make_problem(1)
    cpu_dispatch._engines_plan(gate_up, down, resolve_activation("silu"))
    small = gate_up[0].numel() * gate_up.element_size()
    assert (
        cpu_dispatch._experts_per_call(1, 8, small) == 4 and cpu_dispatch._experts_per_call(95, 8, small) == 1
    )
    # Large experts: fewer a call (a Qwen1.5-MoE-A2.7B fp32 expert's 35 MB: one)
    assert (
        cpu_dispatch._experts_per_call(1, 60, 35 << 20) == 1
        and cpu_dispatch._experts_per_call(1, 128, 19 << 20) == 3
    )
    # 1-8 rows: 4 experts a call; 23 rows and more: 1
    assert {len(experts) for experts in groups["skinny"]} == {4, 1}
    assert {len(experts) for experts in groups["grouped"]} == {4, 1}


def test_engine_measurement_credits_one_call_for_many_experts(calibrating, monkeypatch) -> None:
    """-quant's experts on the kernel share one call per layer, the others take a call each: an engine that
    costs the same per call as the others do per expert must win where it batches (timed one expert a call,
    it tied, and three GEMVs per one-row expert stayed at 1.11x stock)."""
    assert cpu_native.available(), cpu_native.why_unavailable()
    per_call = 0.01
    monkeypatch.setattr(torch_moe, "linear_expert_mlp", _slow(per_call, torch_moe.linear_expert_mlp))
    monkeypatch.setattr(
        torch_moe, "linear_experts_on_kernel", _slow(per_call, torch_moe.linear_experts_on_kernel)
    )
    ops = linear_ops(linear_experts())
    assert ops[:4] == ("skinny",) * 4  # 1-15 rows; timed at 1, 2, 4, 8 rows, 4 experts a call
    # From 16 rows (timed at 23, 47, 95) one expert a call: nothing batched to credit; the faster engine wins.
    assert set(ops[4:]) <= {"skinny", "row"}


def test_engine_ties_keep_the_grouped_gemm(calibrating, monkeypatch) -> None:
    monkeypatch.setattr(cpu_dispatch, "_median", lambda values: 1.0)  # every engine equally fast
    _, gate_up, down, _, _ = make_problem(1)
    plan, _ = cpu_dispatch._engines_plan(gate_up, down, resolve_activation("silu"))
    assert plan.ops == ("grouped",) * ROW_CLASSES


# With several intra-op threads, the calibration also times whole experts on single-threaded workers, with the
# engines measured in the calling thread (measured once per shape); the caller's thread count is left as it was.
def test_calibration_times_worker_threads_when_there_are_threads(calibrating, monkeypatch) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        problem = make_problem(40, dtype=torch.bfloat16)
        plan = cpu_dispatch.plan_for(problem[0], problem[1], problem[2], problem[3])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    plans = json.loads(cpu_dispatch.cache_path().read_text())["plans"]
    prefix = f"bfloat16|E8|K2|H{HIDDEN}|I{INTERMEDIATE}|threads2"
    assert not any("workers" in key for key in plans)  # no second engine measurement on a worker
    assert {"stock", "layerswap", "layerswapx2"} <= set(plans[f"{prefix}|T64"]["median_ms"])
    assert plan.label in plans[f"{prefix}|T64"]["median_ms"]
    if plan.strategy == "layerswap":
        assert plan.ops == tuple(plans[f"{prefix}|engines"]["ops"])

    cpu_dispatch.clear_memory_cache()  # a new process reads the plan, its workers included, back from the file
    assert cpu_dispatch._cache().get(f"{prefix}|T64") == plan


# A real calibration, end to end: the first no-grad call measures and caches, later calls only look up; bf16
# also measures upcast's crossover (one entry per shape), and every entry lands in the file.
def test_calibration_runs_once_per_bucket_and_is_cached(calibrating, monkeypatch) -> None:
    calls = []
    real = cpu_dispatch._calibrate_bucket
    monkeypatch.setattr(cpu_dispatch, "_calibrate_bucket", lambda *a: calls.append(a[4]) or real(*a))
    problem = make_problem(40, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            check(fused_moe(*problem), expected(*problem), torch.bfloat16)
        fused_moe(*make_problem(1, dtype=torch.bfloat16))
    assert calls == [64, 1]
    plans = json.loads(cpu_dispatch.cache_path().read_text())["plans"]
    prefix = f"bfloat16|E8|K2|H{HIDDEN}|I{INTERMEDIATE}|threads{torch.get_num_threads()}"
    expected_keys = {f"{prefix}|T64", f"{prefix}|T1", f"{prefix}|crossover", f"{prefix}|engines"}
    assert set(plans) == expected_keys
    assert len(plans[f"{prefix}|engines"]["ops"]) == ROW_CLASSES
    assert {"stock", "layerswap"} <= set(plans[f"{prefix}|T64"]["median_ms"])

    cpu_dispatch.clear_memory_cache()  # a new process: the file answers, nothing is measured
    monkeypatch.setattr(cpu_dispatch, "_calibrate_bucket", lambda *a: pytest.fail("measured again"))
    plan = cpu_dispatch.plan_for(problem[0], problem[1], problem[2], problem[3])
    assert plan.source == "cached" and plan.strategy == plans[f"{prefix}|T64"]["strategy"]


# Measured while other work competes for the cores: used by this process, not written for the next ones.
def test_a_calibration_on_a_busy_machine_is_not_written(calibrating, monkeypatch) -> None:
    monkeypatch.setattr(cpu_dispatch, "_machine_busy", lambda: True)
    problem = make_problem(16)
    with torch.no_grad():
        check(fused_moe(*problem), expected(*problem), torch.float32)
    assert cpu_dispatch.plan_for(problem[0], problem[1], problem[2], problem[3]).source == "calibrated"
    assert not any(calibrating.iterdir())


def test_no_calibration_when_opted_out(calibrating, monkeypatch) -> None:
    monkeypatch.setenv(cpu_dispatch.ENV_CALIBRATION, "0")
    monkeypatch.setattr(
        cpu_dispatch, "_calibrate_bucket", lambda *a: pytest.fail("calibrated although opted out")
    )
    problem = make_problem(40, dtype=torch.bfloat16)
    with torch.no_grad():
        check(fused_moe(*problem), expected(*problem), torch.bfloat16)
    plan = cpu_dispatch.plan_for(problem[0], problem[1], problem[2], problem[3])
    assert plan == cpu_dispatch.rule_plan(torch.bfloat16) and plan.source == "rule"
    assert not any(calibrating.iterdir())


# Never while torch.compile traces, never on meta tensors: the rule stands in (and is not remembered, so the
# next eager call still calibrates).
def test_no_calibration_while_compiling_or_on_meta(calibrating, monkeypatch) -> None:
    monkeypatch.setattr(cpu_dispatch, "_calibrate_bucket", lambda *a: pytest.fail("calibrated"))
    problem = make_problem(8)
    meta = [t.to("meta") for t in problem]
    assert cpu_dispatch.plan_for(meta[0], meta[1], meta[2], meta[3]).source == "rule"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert cpu_dispatch.plan_for(problem[0], problem[1], problem[2], problem[3]).source == "rule"
    assert not any(calibrating.iterdir())


# --- the cache ------------------------------------------------------------------------------------------------


def test_cache_file_is_keyed_by_machine(calibrating, monkeypatch) -> None:
    here = cpu_dispatch.cache_path()
    assert here.parent == calibrating and here.name.startswith("cpu-dispatch-")
    cpu_dispatch._machine_digest.cache_clear()
    monkeypatch.setattr(
        cpu_dispatch, "cpu_info", lambda: CpuInfo("Other CPU", ("avx2", "amx_bf16"), "AVX512", 64)
    )
    try:
        assert cpu_dispatch.cache_path() != here
        assert json.dumps(cpu_dispatch.machine_key())
        assert cpu_dispatch.machine_key()["cpu"] == "Other CPU"
        assert cpu_dispatch.machine_key()["torch"] == torch.__version__
    finally:
        cpu_dispatch._machine_digest.cache_clear()


def test_an_edited_kernel_or_turning_it_off_is_a_new_cache_file(calibrating, monkeypatch) -> None:
    # Decisions measured with one build of the kernel are not reused by another, nor without the kernel.
    here = cpu_dispatch.cache_path()
    for identity in ("layerswap_cpu_0123456789ab", "off"):
        cpu_dispatch._machine_digest.cache_clear()
        monkeypatch.setattr(cpu_native, "identity", lambda identity=identity: identity)
        try:
            assert cpu_dispatch.cache_path() != here
            assert cpu_dispatch.machine_key()["kernel"] == identity
        finally:
            cpu_dispatch._machine_digest.cache_clear()


def test_the_kernels_identity_is_its_name_or_off(monkeypatch) -> None:
    assert cpu_native.identity() == cpu_native.extension_name()
    monkeypatch.setenv(cpu_native.ENV_KERNEL, "0")
    assert cpu_native.identity() == "off"


def test_cache_default_location(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(cpu_dispatch.ENV_CACHE_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpu_dispatch.cache_dir() == tmp_path / "layerswap"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cpu_dispatch.cache_dir() == tmp_path / ".cache" / "layerswap"


# Two processes (here, two cache objects on one file) writing different entries: both survive, the file is
# always whole JSON, and no temporary file is left behind.
def test_concurrent_writers_merge_and_leave_no_temp_files(calibrating) -> None:
    path = calibrating / "cpu-dispatch-test.json"
    writers = [cpu_dispatch.PlanCache(path) for _ in range(4)]
    errors = []

    def write(index: int) -> None:
        try:
            for step in range(10):
                writers[index].put(f"w{index}|{step}", Plan("stock"), {"stock": 1.0})
                json.loads(path.read_text())  # never a half-written file
        except Exception as error:  # reported below, with the thread's name
            errors.append(error)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    # A read-merge-write racing another can drop that one's newest entry (measured again by a later process);
    # what is there is whole and was written by someone.
    plans = json.loads(path.read_text())["plans"]
    assert plans and set(plans) <= {f"w{i}|{step}" for i in range(4) for step in range(10)}
    assert sorted(p.name for p in calibrating.iterdir()) == [path.name]


# Writers that do not overlap merge: each keeps what the other wrote.
def test_sequential_writers_merge(calibrating) -> None:
    path = calibrating / "cpu-dispatch-test.json"
    first, second = cpu_dispatch.PlanCache(path), cpu_dispatch.PlanCache(path)
    first.put("a", Plan("stock"))
    second.put("b", Plan("upcast", min_rows=3))
    fresh = cpu_dispatch.PlanCache(path)
    assert fresh.get("a") == Plan("stock") and fresh.get("b") == Plan("upcast", min_rows=3)
    assert fresh.get("b").source == "cached"


# A write that fails half-way keeps the previous file and removes its temporary file.
def test_failed_write_keeps_the_old_file(calibrating, monkeypatch) -> None:
    path = calibrating / "cpu-dispatch-test.json"
    cache = cpu_dispatch.PlanCache(path)
    cache.put("first", Plan("stock"))
    before = path.read_text()

    def broken_dump(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(cpu_dispatch.json, "dump", broken_dump)
    cache.put("second", Plan("layerswap"))
    assert path.read_text() == before
    assert sorted(p.name for p in calibrating.iterdir()) == [path.name]
    assert cache.get("second") == Plan("layerswap")  # still known to this process
    assert not cache.writable


# A home that cannot be written (here: the cache dir would sit under a regular file, which fails for root too):
# decisions stay in memory, nothing raises.
def test_unwritable_cache_dir_keeps_decisions_in_memory(calibrating, monkeypatch) -> None:
    blocker = calibrating / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(cpu_dispatch.ENV_CACHE_DIR, str(blocker / "layerswap"))
    cpu_dispatch.clear_memory_cache()
    problem = make_problem(16)
    with torch.no_grad():
        check(fused_moe(*problem), expected(*problem), torch.float32)
    plan = cpu_dispatch.plan_for(problem[0], problem[1], problem[2], problem[3])
    assert plan.source == "calibrated"
    assert not cpu_dispatch._cache().writable


def test_damaged_or_foreign_cache_files_are_ignored(calibrating) -> None:
    path = calibrating / "cpu-dispatch-test.json"
    path.write_text("{not json")
    assert cpu_dispatch.PlanCache(path).get("x") is None
    path.write_text(json.dumps({"format": 999, "plans": {"x": {"strategy": "stock"}}}))
    assert cpu_dispatch.PlanCache(path).get("x") is None
    path.write_text(
        json.dumps({"format": 1, "plans": {"x": {"strategy": "gone", "min_rows": 1, "block_bytes": 8192}}})
    )
    assert cpu_dispatch.PlanCache(path).get("x") is None
    os.remove(path)


# --- experts held as separate projections (-quant's nn.Linear experts) ---------------------------------------------


def linear_experts(num_experts=6, dtype=torch.float32, has_gate=True):
    generator = torch.Generator().manual_seed(0)

    def weight(rows, columns):
        return (torch.randn(rows, columns, generator=generator) * 0.2).to(dtype)

    return [
        (
            weight(INTERMEDIATE, HIDDEN) if has_gate else None,
            weight(INTERMEDIATE, HIDDEN),
            weight(HIDDEN, INTERMEDIATE),
        )
        for _ in range(num_experts)
    ]


def linear_ops(experts, dtype=torch.float32):
    shape = (len(experts), HIDDEN, INTERMEDIATE, experts[0][0] is not None)
    return cpu_dispatch.linear_expert_ops(dtype, shape, lambda: experts, resolve_activation("silu"))


# What is measurably faster per row-count class; nn.Linear's own engine ("row") unless beaten by the margin.
@pytest.mark.parametrize("slow", ["row", "wm"])
def test_linear_engine_measurement_avoids_a_slow_engine(calibrating, monkeypatch, slow: str) -> None:
    real = torch_moe.linear_expert_mlp

    def expert_mlp(*args):
        if args[-1] == slow:
            time.sleep(SLOW_S)
        return real(*args)

    monkeypatch.setattr(torch_moe, "linear_expert_mlp", expert_mlp)
    ops = linear_ops(linear_experts())
    assert len(ops) == ROW_CLASSES and slow not in ops
    assert set(ops) <= set(torch_moe.LINEAR_EXPERT_OPS) and ops[1:].count("mv") == 0  # mv: one row only
    plans = json.loads(cpu_dispatch.cache_path().read_text())["plans"]
    key = f"float32|E6|K0|H{HIDDEN}|I{INTERMEDIATE}|threads{torch.get_num_threads()}|linear-engines"
    assert tuple(plans[key]["ops"]) == ops

    cpu_dispatch.clear_memory_cache()  # a new process reads the decision back, measuring nothing
    monkeypatch.setattr(cpu_dispatch, "_fastest_engines", lambda *a, **k: pytest.fail("measured again"))
    assert linear_ops(linear_experts()) == ops


def test_linear_engine_ties_keep_nn_linears_own(calibrating, monkeypatch) -> None:
    monkeypatch.setattr(cpu_dispatch, "_median", lambda values: 1.0)  # every engine equally fast
    assert linear_ops(linear_experts(has_gate=False)) == cpu_dispatch.ALL_ROW


@pytest.mark.parametrize(
    "forced, ops",
    [
        ("stock", ("row",) * ROW_CLASSES),
        ("upcast", ("row",) * ROW_CLASSES),
        ("layerswap:wm", ("wm",) * ROW_CLASSES),
        ("layerswap:mv", ("mv",) * ROW_CLASSES),
        ("layerswap:grouped", ("row",) * ROW_CLASSES),  # no grouped GEMM over separate weights
    ],
)
def test_linear_engines_follow_a_forced_strategy(calibrating, monkeypatch, forced: str, ops) -> None:
    monkeypatch.setenv(cpu_dispatch.ENV_STRATEGY, forced)
    monkeypatch.setattr(cpu_dispatch, "_fastest_engines", lambda *a, **k: pytest.fail("measured"))
    assert linear_ops(linear_experts()) == ops


def test_linear_engines_are_nn_linears_own_when_calibration_is_off_or_impossible(
    calibrating, monkeypatch
) -> None:
    measured = []
    monkeypatch.setattr(
        cpu_dispatch, "_fastest_engines", lambda *a, **k: measured.append(1) or (("wm",) * ROW_CLASSES, {})
    )
    monkeypatch.setenv(cpu_dispatch.ENV_CALIBRATION, "0")
    assert linear_ops(linear_experts()) == cpu_dispatch.ALL_ROW
    monkeypatch.setenv(cpu_dispatch.ENV_CALIBRATION, "1")
    # Weights that cannot be timed (meta here; tensor subclasses, other devices): nn.Linear's own engine for this
    # call, and the next call with real weights measures.
    meta = [tuple(t.to("meta") for t in weights) for weights in linear_experts()]
    assert linear_ops(meta) == cpu_dispatch.ALL_ROW
    assert not measured and not any(calibrating.iterdir())
    assert linear_ops(linear_experts()) == ("wm",) * ROW_CLASSES
    assert measured == [1]


def test_consecutive_calibration_calls_read_different_experts() -> None:
    """Candidates take turns: each call must find its experts' weights in memory, not in the cache the call
    before it warmed (a 480 MiB L3 holds 50 Qwen3 experts). Calls walk through the layer in steps of their
    footprint: one expert per call visits every expert before any comes back."""

    def experts(n: int, footprint: int, num_experts: int) -> set[int]:
        first = cpu_dispatch._experts_of_call(n, footprint, num_experts)
        return {(first + j) % num_experts for j in range(footprint)}

    for num_experts in (6, 8, 60, 128):
        assert sorted(cpu_dispatch._experts_of_call(n, 1, num_experts) for n in range(num_experts)) == list(
            range(num_experts)
        )
        for footprint in (1, 2, 3, num_experts // 2):
            for n in range(2 * num_experts):
                assert not experts(n, footprint, num_experts) & experts(n + 1, footprint, num_experts)


def test_calibration_slices_are_large_enough_to_judge_the_layer() -> None:
    """A round covers every expert at decode, else about 8 active experts and up to ~256 rows: on a 2-expert
    slice (its bound was 64 rows) stock's fixed costs made it look slower than it is on the whole layer."""
    num_experts, top_k = 128, 8  # Qwen3-30B-A3B
    assert cpu_dispatch._window(1, num_experts, top_k) == num_experts
    assert cpu_dispatch._window(512, num_experts, top_k) == 8  # 32 rows each
    for bucket in (16, 128, 512, 2048):
        window = cpu_dispatch._window(bucket, num_experts, top_k)
        rows_per_expert = bucket * top_k / num_experts
        assert 2 <= window <= 16 and window * rows_per_expert <= 256 + rows_per_expert


def test_calibration_timing_walks_the_experts() -> None:
    seen: list[int] = []
    engine = cpu_dispatch._on_next_expert(seen.append, 8)
    times = cpu_dispatch._interleaved_ms({"stock": engine}, 4, 4, 0.0, seed=0)
    assert len(times["stock"]) == 4
    # The warm-up and the four timed calls each ran the expert after the one before.
    assert [(b - a) % 8 for a, b in itertools.pairwise(seen)] == [1] * 4


def test_calibration_stops_timing_hopeless_candidates() -> None:
    """Far slower candidates stop after the first round (their one call is enough to rule them out), slower
    ones after the third; stock, the reference of every decision, is timed every round however slow."""

    def sleeping(seconds: float) -> cpu_dispatch.Call:
        return lambda _round, _call: time.sleep(seconds)

    calls = {
        "fast": sleeping(0.002),
        "slower": sleeping(0.002 * (cpu_dispatch._DROP_FACTOR + cpu_dispatch._EARLY_DROP_FACTOR) / 2),
        "hopeless": sleeping(0.002 * cpu_dispatch._EARLY_DROP_FACTOR * 3),
        "stock": sleeping(0.002 * cpu_dispatch._EARLY_DROP_FACTOR * 3),
    }
    times = cpu_dispatch._interleaved_ms(calls, 5, 5, 0.0, seed=0)
    assert {name: len(values) for name, values in times.items()} == {
        "fast": 5,
        "slower": 3,
        "hopeless": 1,
        "stock": 5,
    }


def test_calibration_stops_once_a_candidate_leads_clearly() -> None:
    """Rounds beyond the minimum are spent only where candidates are close: once one candidate's slowest call
    beats every other's fastest (after the minimum rounds, or by `early_gap` after two), the order is settled."""

    def sleeping(seconds: float) -> cpu_dispatch.Call:
        return lambda _round, _call: time.sleep(seconds)

    calls = {"fast": sleeping(0.001), "stock": sleeping(0.02)}

    def rounds(**kwargs) -> set[int]:
        times = cpu_dispatch._interleaved_ms(calls, 3, 12, 60.0, seed=0, **kwargs)
        return {len(values) for values in times.values()}

    assert rounds() == {12}  # the budget lasts: every round
    assert rounds(until_clear=True) == {3}
    assert rounds(until_clear=True, early_gap=1.25) == {2}


def test_a_clear_leader_is_faster_in_every_call() -> None:
    times = {"a": [1.0, 1.2, 1.1], "b": [1.3, 1.4, 1.25], "stock": [2.0, 2.1, 1.9]}
    assert cpu_dispatch._clear_leader(times, list(times), 1.0)
    assert not cpu_dispatch._clear_leader(times, list(times), 1.1)  # 1.1 x 1.2 > 1.25
    times["b"][2] = 1.15  # below a's slowest call
    assert not cpu_dispatch._clear_leader(times, list(times), 1.0)
    assert cpu_dispatch._clear_leader(times, ["a", "stock"], 1.0)  # b no longer timed: only the others count


def test_engine_warm_up_runs_one_expert() -> None:
    """The untimed warm-up compiles and allocates for the row count on one expert, not the call's four."""
    seen: list[list[int]] = []
    call = cpu_dispatch._on_next_experts(lambda experts: seen.append(list(experts)), 4, 16)
    cpu_dispatch._interleaved_ms({"stock": call}, 3, 3, 0.0, seed=0)
    assert [len(experts) for experts in seen] == [1, 4, 4, 4]


def test_engines_hopeless_at_few_rows_are_not_timed_at_more(calibrating, monkeypatch) -> None:
    """An engine far slower than the best at one row count is not timed at the larger ones, except the
    reference, which a tie keeps."""
    slow_op, fast_op = "wm", "mv"

    def engine(op, rows, m):
        def run(experts):
            time.sleep(0.0005 if op == fast_op else 0.02 if op == slow_op else 0.002)

        return run

    ops = ("grouped", "mv", "row", "wm")
    chosen, medians = cpu_dispatch._fastest_engines(ops, "grouped", engine, 8, 64, torch.float32, 1 << 20)
    assert f"{slow_op}@1" in medians and f"{slow_op}@2" not in medians  # 40x the GEMV at one row
    assert all(f"grouped@{m}" in medians for m in cpu_dispatch._ENGINE_ROWS)  # the reference: always
    assert chosen[0] == fast_op and slow_op not in chosen


@pytest.fixture
def fp32_matmul_precision():
    """Sets torch's fp32 matmul precision for one test, restoring it after (it is process-wide)."""
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    yield lambda mode: setattr(matmul, "fp32_precision", mode)
    matmul.fp32_precision = before


def test_fp32_decisions_are_measured_per_matmul_precision(
    calibrating, monkeypatch, fp32_matmul_precision
) -> None:
    """With fp32 matmuls allowed to run in bf16 (set_float32_matmul_precision("medium")), an AMX CPU orders the
    engines differently: a decision measured in full fp32 must not be reused there, nor the reverse."""
    measured = []
    monkeypatch.setattr(
        cpu_dispatch,
        "_fastest_engines",
        lambda *a, **k: measured.append(cpu_dispatch.fp32_matmul_mode()) or (("wm",) * ROW_CLASSES, {}),
    )
    fp32_matmul_precision("none")
    full_key = cpu_dispatch._shape_key(torch.float32, 8, 2, 64, 32)
    bf16_key = cpu_dispatch._shape_key(torch.bfloat16, 8, 2, 64, 32)
    linear_ops(linear_experts())
    linear_ops(linear_experts())
    fp32_matmul_precision("bf16")
    assert cpu_dispatch.fp32_matmul_mode() == "bf16"
    assert cpu_dispatch._shape_key(torch.float32, 8, 2, 64, 32) == f"{full_key}|fp32-bf16"
    assert (
        cpu_dispatch._shape_key(torch.bfloat16, 8, 2, 64, 32) == bf16_key
    )  # bf16 decisions do not depend on it
    linear_ops(linear_experts())
    fp32_matmul_precision("none")
    linear_ops(linear_experts())  # back to full fp32: the first decision, from memory
    assert measured == ["none", "bf16"]
