"""layerswap's CPU kernel (cpu_gemm.cpp through cpu_native): built here, each instruction set it has against a
float64 reference on the shapes that reach each of its code paths, its errors, and what happens without it."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from layerswap.kernels import _workers, cpu_native, torch_moe


@pytest.fixture
def fresh_kernel_state():
    """Forget the loaded kernel (and its availability) before and after: the test sets its own conditions."""
    cpu_native._forget()
    yield
    cpu_native._forget()


def test_builds_on_this_machine() -> None:
    # CI has a C++ compiler and ninja (optimum-quanto builds its extensions with them too) on an x86-64 CPU.
    assert cpu_native.available(), cpu_native.why_unavailable()
    assert cpu_native.why_unavailable() is None
    assert "avx2" in cpu_native.supported_isas()


def _bf16(generator: torch.Generator, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(dtype)


# fp32 accumulation; bf16 is then rounded once (8 bits): within 2**-8 of the largest output. fp32 keeps 24 bits,
# and a sum over up to 2049 terms loses ~log2(2049) of them in the worst case.
RELATIVE_TOLERANCE = {torch.bfloat16: 2**-8, torch.float32: 2**-16}


def _assert_close_to_float64(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = x.double() @ w.double().T
    tolerance = want.abs().max().item() * RELATIVE_TOLERANCE[x.dtype] + 1e-6
    assert got.dtype == x.dtype and got.shape == want.shape
    assert (got.double() - want).abs().max().item() <= tolerance


# Rows: 1 (a GEMV; AVX2: one weight row at a time, 64 bf16 or 32 fp32 values a step, then 16 or 8, then scalar),
# 2-3 (AVX-512: 8-weight-row blocks; AVX2: 2 bf16 rows streamed like one, else pair tiles), 4-7 (4 x 6 tiles, with
# 4-5 left over; AVX2: pair tiles of 4, 3 and 2 rows, bf16 on its input rows split even/odd), 13 and 20 (several
# tiles; AVX2: pair tiles for bf16, 3-row tiles for fp32 at 20), 40 (AVX2: bf16 on fp32 copies of its weights). (N, K): N = 1 and N not a multiple of 8 or 4 (the last weight rows one at a time); K below one vector, not a multiple of 32 or 8 (the masked / scalar
# tail), and real layer sizes (2048 x 1536).
SHAPES = [(1, 1), (7, 31), (9, 33), (13, 8), (64, 48), (48, 64), (130, 2049), (1536, 2048)]


DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)


@DTYPES
@pytest.mark.parametrize("isa", cpu_native.supported_isas())
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 20, 40])
def test_matches_float64_on_every_tile_shape(isa: str, rows: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(rows)
    for columns, depth in SHAPES:
        x, w = _bf16(generator, rows, depth, dtype=dtype), _bf16(generator, columns, depth, dtype=dtype)
        _assert_close_to_float64(cpu_native.skinny_mm(x, w, isa=isa), x, w)


@DTYPES
@pytest.mark.parametrize("isa", cpu_native.supported_isas())
def test_strided_operands_and_output(isa: str, dtype: torch.dtype) -> None:
    # An expert's rows are a slice of the gathered rows, and its output a slice of one buffer: row strides
    # differ from the widths, and the output's columns are a window of a wider row.
    generator = torch.Generator().manual_seed(1)
    x = _bf16(generator, 5, 100, dtype=dtype)[:, 10:74]  # [5, 64], row stride 100
    w = _bf16(generator, 40, 80, dtype=dtype)[:, :64]  # [40, 64], row stride 80
    buffer = torch.zeros(5, 50, dtype=dtype)
    result = cpu_native.skinny_mm(x, w, buffer[:, 3:43], isa=isa)
    _assert_close_to_float64(result, x, w)
    assert result.data_ptr() == buffer[:, 3:43].data_ptr()
    assert buffer[:, :3].eq(0).all() and buffer[:, 43:].eq(0).all()  # nothing written outside the window


# One nonzero product per output: its sum is that product exactly, so the output is the product rounded once,
# as torch rounds it (bf16: to nearest even); NaN and infinity come through. 8 rows and 8 weight rows: whole
# 4 x 4 groups (the outputs stored four at a time) and, with 1 row, the one-by-one path.
@DTYPES
@pytest.mark.parametrize("isa", cpu_native.supported_isas())
@pytest.mark.parametrize("rows", [1, 8])
def test_outputs_are_rounded_once_and_keep_nan_and_infinity(isa: str, rows: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(4)
    x, w = torch.zeros(rows, 64, dtype=dtype), torch.zeros(8, 64, dtype=dtype)
    x[:, 5] = _bf16(generator, rows, dtype=dtype) * 3
    w[:, 5] = _bf16(generator, 8, dtype=dtype) * 3
    w[3, 5] = float("inf")
    x[0, 5] = float("nan")
    want = (x[:, 5, None].float() * w[None, :, 5].float()).to(dtype)
    got = cpu_native.skinny_mm(x, w, isa=isa)
    assert got[0].isnan().all() and got[1:, 3].isinf().all()
    finite = want.isfinite()
    assert torch.equal(got[finite], want[finite])


def test_the_instruction_sets_agree() -> None:
    isas = cpu_native.supported_isas()
    if len(isas) < 2:
        pytest.skip(f"this CPU runs only {isas}")  # AVX2-only CPUs: nothing to compare
    generator = torch.Generator().manual_seed(2)
    x, w = _bf16(generator, 3, 2048), _bf16(generator, 768, 2048)
    results = [cpu_native.skinny_mm(x, w, isa=isa).float() for isa in isas]
    # Both accumulate in fp32 in a different order: at most one bf16 rounding step apart.
    assert torch.allclose(results[0], results[1], rtol=2**-7, atol=2**-7 * results[0].abs().max().item())


@DTYPES
@pytest.mark.parametrize("rows", [3, 8, 40])
def test_same_bits_on_any_thread_count(dtype: torch.dtype, rows: int) -> None:
    # Each output element is summed by one thread in a fixed order: two processes with different thread counts
    # must compute the same numbers (40 rows: AVX2's bf16 runs on fp32 copies, one scratch buffer per thread).
    generator = torch.Generator().manual_seed(3)
    x, w = _bf16(generator, rows, 2048, dtype=dtype), _bf16(generator, 1536, 2048, dtype=dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_native.skinny_mm(x, w)
        torch.set_num_threads(2)
        shared = cpu_native.skinny_mm(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, shared)


def test_a_single_threaded_worker_stays_single_threaded_after_the_kernel() -> None:
    # at::parallel_for compiled into the kernel once reset a worker thread to the process-wide thread count on
    # its first call there: every expert worker then ran 2-thread GEMMs side by side for the rest of the process.
    generator = torch.Generator().manual_seed(4)
    x, w = _bf16(generator, 1, 256), _bf16(generator, 1024, 256)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        expected = x.float() @ w.float().T
        ran = _workers.run_split(lambda group: cpu_native.skinny_mm(x, w), [[0], [1]], workers=2)
        for out in ran:
            assert torch.allclose(out.float(), expected, rtol=2**-7, atol=2**-7 * expected.abs().max().item())
        assert _workers.run_split(lambda group: torch.get_num_threads(), [[0], [1]], workers=2) == [1, 1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_empty_inputs() -> None:
    w = torch.ones(8, 16, dtype=torch.bfloat16)
    assert cpu_native.skinny_mm(torch.ones(0, 16, dtype=torch.bfloat16), w).shape == (0, 8)
    assert cpu_native.skinny_mm(torch.ones(2, 16, dtype=torch.bfloat16), w[:0]).shape == (2, 0)


@pytest.mark.parametrize(
    "x, w, out, message",
    [
        (
            torch.ones(2, 8, dtype=torch.float16),
            torch.ones(4, 8, dtype=torch.float16),
            None,
            "must be bfloat16, or every one float32",
        ),
        (
            torch.ones(2, 8),
            torch.ones(4, 8, dtype=torch.bfloat16),
            None,
            "must be bfloat16, or every one float32",
        ),
        (torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(4, 9, dtype=torch.bfloat16), None, "must match"),
        (
            torch.ones(8, 2, dtype=torch.bfloat16).t(),
            torch.ones(4, 8, dtype=torch.bfloat16),
            None,
            "contiguous",
        ),
        (
            torch.ones(2, 8, dtype=torch.bfloat16),
            torch.ones(4, 8, dtype=torch.bfloat16),
            torch.empty(2, 5, dtype=torch.bfloat16),
            "out must be",
        ),
    ],
    ids=["fp16", "mixed_dtypes", "depth_mismatch", "strided_last_dim", "wrong_out"],
)
def test_bad_operands_name_the_problem(x, w, out, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        cpu_native.skinny_mm(x, w, out)


def test_unknown_isa_is_refused() -> None:
    x = torch.ones(1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="isa must be one of"):
        cpu_native.skinny_mm(x, x, isa="neon")


def test_aten_cpu_capability_caps_the_kernel_too(fresh_kernel_state, monkeypatch) -> None:
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert cpu_native.supported_isas() == ("avx2",)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    cpu_native._forget()
    assert not cpu_native.available()
    assert "none of" in cpu_native.why_unavailable()


# Without the kernel: engine "skinny" runs as "wm", the same numbers torch's weight-major GEMM gives.
def test_disabled_kernel_falls_back_to_weight_major(fresh_kernel_state, monkeypatch) -> None:
    monkeypatch.setenv(cpu_native.ENV_KERNEL, "0")
    assert not cpu_native.available()
    assert cpu_native.ENV_KERNEL in cpu_native.why_unavailable()
    with pytest.raises(RuntimeError, match="not available"):
        cpu_native.skinny_mm(torch.ones(1, 8, dtype=torch.bfloat16), torch.ones(2, 8, dtype=torch.bfloat16))
    generator = torch.Generator().manual_seed(4)
    rows, gate_up, down = _bf16(generator, 3, 64), _bf16(generator, 96, 64), _bf16(generator, 64, 48)
    act = torch.nn.functional.silu
    with torch.no_grad():
        skinny = torch_moe._expert_mlp(rows, gate_up, down, act, out=torch.empty_like(rows), op="skinny")
        wm = torch_moe._expert_mlp(rows, gate_up, down, act, out=torch.empty_like(rows), op="wm")
    assert torch.equal(skinny, wm)


def test_first_calls_from_two_threads_at_once_load_one_kernel() -> None:
    # The expert workers' first kernel calls come together. Two concurrent loads once made torch's loader
    # version the second library (`<name>_v1`): a second build, and in a fresh process the ops missing where
    # they were looked up. Fresh processes: one builds the library, then one where nothing is loaded yet.
    script = (
        "import threading\n"
        "from layerswap.kernels import cpu_native\n"
        "barrier, kernels = threading.Barrier(2), []\n"
        "def first_call():\n"
        "    barrier.wait()\n"
        "    kernels.append(cpu_native._load())\n"
        "threads = [threading.Thread(target=first_call) for _ in range(2)]\n"
        "[thread.start() for thread in threads]\n"
        "[thread.join() for thread in threads]\n"
        "assert kernels[0] is kernels[1], kernels\n"
        "assert cpu_native.available(), cpu_native.why_unavailable()\n"
    )
    build = "from layerswap.kernels import cpu_native\nassert cpu_native.available()\n"
    subprocess.run([sys.executable, "-c", build], check=True, capture_output=True, timeout=300)
    built = cpu_native._build_dir(cpu_native.extension_name())  # this test's cache dir (conftest)
    libraries = sorted(built.glob("*.so"))
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=300)
    assert sorted(built.glob("*.so")) == libraries  # nothing built again


def test_a_failed_build_warns_and_leaves_torchs_engines(fresh_kernel_state, monkeypatch, caplog) -> None:
    from torch.utils import cpp_extension

    def failing_load(**kwargs):
        raise RuntimeError("Error building extension: c++: not found")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert not cpu_native.available()
    assert "c++: not found" in cpu_native.why_unavailable()
    assert "no CPU kernel" in caplog.text


def test_unwritable_cache_builds_in_the_temp_dir(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(
        "LAYERSWAP_CACHE_DIR", str(blocker / "layerswap")
    )  # a directory under a file: unwritable
    directory = cpu_native._build_dir("layerswap_cpu_test")
    assert directory.is_dir() and not str(directory).startswith(str(blocker))


def test_an_edited_source_gets_a_new_name(tmp_path, monkeypatch) -> None:
    edited = tmp_path / "cpu_gemm.cpp"
    edited.write_bytes(cpu_native.SOURCE.read_bytes() + b"\n// edited\n")
    before = cpu_native.extension_name()
    monkeypatch.setattr(cpu_native, "SOURCE", edited)
    assert cpu_native.extension_name() != before


# --- the gated SiLU MLP, one expert and several in one call ---------------------------------------------------


def _mlp_weights(generator: torch.Generator, hidden: int, intermediate: int, dtype: torch.dtype):
    gate = torch.randn(intermediate, hidden, generator=generator) * hidden**-0.5
    up = torch.randn(intermediate, hidden, generator=generator) * hidden**-0.5
    down = torch.randn(hidden, intermediate, generator=generator) * intermediate**-0.5
    return gate.to(dtype), up.to(dtype), down.to(dtype)


def _mlp_float64(x, gate, up, down):
    x = x.double()
    return (F.silu(x @ gate.double().T) * (x @ up.double().T)) @ down.double().T


# The kernel forms silu(gate) * up from fp32 sums and rounds the product once; torch rounds gate, up, the SiLU and
# the product to bf16 each. Both land within a few bf16 steps of float64.
MLP_TOLERANCE = {torch.bfloat16: 2**-6, torch.float32: 2**-16}


@DTYPES
@pytest.mark.parametrize("isa", cpu_native.supported_isas())
# (rows, H, I): one row; a real layer's sizes; H and I below and off one vector; more rows than one tile holds.
@pytest.mark.parametrize(
    "rows, hidden, intermediate", [(1, 64, 48), (3, 2048, 768), (5, 33, 17), (13, 130, 70)]
)
def test_silu_mlp_matches_float64(isa, dtype, rows, hidden, intermediate) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = _bf16(generator, rows, hidden, dtype=dtype)
    gate, up, down = _mlp_weights(generator, hidden, intermediate, dtype)
    got = cpu_native.skinny_silu_mlp(x, gate, up, down, isa=isa)
    want = _mlp_float64(x, gate, up, down)
    assert got.dtype == dtype and got.shape == want.shape
    assert (got.double() - want).abs().max() <= want.abs().max() * MLP_TOLERANCE[dtype] + 1e-6


@DTYPES
def test_several_experts_in_one_call(dtype) -> None:
    # Experts on rows 0-2, 5, and 6-10, with rows 3-4 (another engine's) between them: those stay untouched.
    # gate_up-style views (gate and up as two halves of one [2I, H] weight) as the fused path passes them.
    generator = torch.Generator().manual_seed(5)
    x = _bf16(generator, 11, 64, dtype=dtype)
    experts = [_mlp_weights(generator, 64, 48, dtype) for _ in range(3)]
    fused = torch.cat([experts[1][0], experts[1][1]])
    gates = [experts[0][0], fused[:48], experts[2][0]]
    ups = [experts[0][1], fused[48:], experts[2][1]]
    downs = [e[2] for e in experts]
    bounds = [0, 3, 5, 6, 6, 11]
    out = torch.full_like(x, 7.0)
    cpu_native.skinny_silu_experts(x, gates, ups, downs, bounds, out)
    for j, expert in enumerate(experts):
        rows = slice(bounds[2 * j], bounds[2 * j + 1])
        want = _mlp_float64(x[rows], *expert)
        assert (out[rows].double() - want).abs().max() <= want.abs().max() * MLP_TOLERANCE[dtype] + 1e-6
    assert out[3:5].eq(7.0).all()
    # The same numbers as one call per expert.
    for j in range(3):
        rows = slice(bounds[2 * j], bounds[2 * j + 1])
        assert torch.equal(out[rows], cpu_native.skinny_silu_mlp(x[rows], gates[j], ups[j], downs[j]))


def test_bad_expert_lists_name_the_problem() -> None:
    x = torch.ones(4, 8, dtype=torch.bfloat16)
    gate = torch.ones(6, 8, dtype=torch.bfloat16)
    down = torch.ones(8, 6, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    with pytest.raises(RuntimeError, match="two row bounds each"):
        cpu_native.skinny_silu_experts(x, [gate], [gate], [down], [0], out)
    with pytest.raises(RuntimeError, match="not within the 4 rows"):
        cpu_native.skinny_silu_experts(x, [gate], [gate], [down], [2, 5], out)
    with pytest.raises(RuntimeError, match="expected gate and up"):
        cpu_native.skinny_silu_experts(x, [gate], [gate], [gate], [0, 4], out)
    with pytest.raises(RuntimeError, match="out must be"):
        cpu_native.skinny_silu_mlp(x, gate, gate, down, out[:2])
