"""Which CPU strategy runs the fused-MoE experts, chosen per machine by measurement.

The fastest way to run MoE experts on a CPU depends on the CPU: on a Sapphire Rapids (AMX), oneDNN's
weight-major bf16 GEMM streams at bandwidth; on an AMD EPYC with AVX512-BF16 (one thread) the same call
streams at 11 GB/s where `x @ W.T` reaches 15-18 for 1-8 rows; on an AVX2-only CPU (AMD Zen 2/3, older Xeons) torch's bf16 GEMM
is a scalar-speed loop and converting each expert's weights to fp32 in cache is 2-4x faster from ~4 rows per
expert on. So for each shape the first no-grad CPU call measures which engine (`torch_moe.EXPERT_OPS`) runs
one expert's MLP fastest per row-count class (timed at 1, 2, 4, 8, 23, 47, 95 rows; `_engines_plan`), and for
bf16/fp16 from how many rows `upcast` pays (`_crossover_plan`); then for each (dtype, token-count bucket,
shape) a short calibration runs each candidate strategy (`stock`, whose computation is stock transformers'
`grouped_mm`, `layerswap` with the measured engines, in this thread and, with several intra-op threads,
split over single-threaded worker threads with the same engines, and for bf16/fp16 `upcast`) on a slice of the real problem (the
bucket's routing restricted to a few experts), taking turns call by call so that load from other processes
hits every candidate alike, until one candidate leads clearly or a short budget is spent (`_interleaved_ms`).
Every calibration call, of every candidate, runs on the experts after those of the call before it, so its
weights come from memory as in a real forward pass, not from the cache the previous candidate warmed.
The fastest wins only by a margin over stock (`_MARGIN`), so the worst case is stock's speed. `-quant`'s experts,
three separate nn.Linear projections each, get the same per-row-count measurement over their own layout
(`linear_expert_ops`), where nn.Linear's own `x @ W.T` is the reference to beat. Decisions are
cached in memory and on disk, keyed by the CPU model, its flags, its core count, torch's version and thread
count, the strategy set's version, the build of layerswap's kernel (`cpu_native.identity`: a digest of its
source, or "off"), and any instruction-set cap set in the environment (`ISA_LIMIT_ENV`:
ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS, ATEN_CPU_CAPABILITY, ...), which the libraries read at start-up;
fp32 decisions also by the fp32 matmul precision (`fp32_matmul_mode`), which a program may change at any time.

Environment variables:
- LAYERSWAP_CPU_CALIBRATION=0: never measure; capability rules decide (`rule_plan`), no cache is read or written.
- LAYERSWAP_CPU_STRATEGY=stock|layerswap[:engine[:workers]]|upcast[:min_rows]: force one strategy (tests,
  benchmarks, bug reports); `layerswap:row` runs every expert on one engine (grouped, mv, row or wm),
  `layerswap:row:2` on two single-threaded worker threads (`_workers`).
- LAYERSWAP_CACHE_DIR: the cache directory (default $XDG_CACHE_HOME/layerswap, else ~/.cache/layerswap).
  Writes are atomic (a temporary file, then os.replace), merged with what other processes wrote meanwhile;
  where the directory cannot be written, decisions stay in memory for the process. A decision measured
  while the machine was busy (load average above 1.5 per core) also stays in memory only. Delete the
  directory to measure again.

Calibration never runs while torch.compile traces, on the meta device, on tensor subclasses, or on
non-CPU tensors: those get the cached decision if there is one, else the capability rule.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import logging
import math
import os
import platform
import random
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from . import _cpu_strategies as strategies
from . import cpu_native, torch_moe
from ._cache import ENV_CACHE_DIR as ENV_CACHE_DIR  # one of the variables documented above
from ._cache import cache_dir
from ._cpu_strategies import STRATEGIES, Plan
from .torch_moe import Activation, fused_moe_reference, resolve_activation

logger = logging.getLogger(__name__)

ENV_CALIBRATION = "LAYERSWAP_CPU_CALIBRATION"
ENV_STRATEGY = "LAYERSWAP_CPU_STRATEGY"

# Bump when a strategy's implementation or how it is measured changes, so decisions measured on the old code
# are not reused. (An edit of the kernel's C++ source needs no bump: the cache key carries its digest.)
# 2: per-row-count engines in `layerswap`; 3: calibration calls never share experts; 4: the "skinny" engine;
# 5: classes from 16 rows timed at counts inside them (23, 47, 95), -quant's with the layer's output copy;
# 6: engines timed on several experts a call, run as the layer runs them, and larger slices from T=512;
# 7: the "skinny" engine timed at every row count, not only up to 8 rows; 8: a `layerswap` plan's worker threads
# are used (before, its experts ran in the calling thread, so the worker candidate was timed without them), and
# the worker candidate runs the engines measured in the calling thread; 9: timing stops once a candidate leads
# clearly (engines: after two rounds by `_ENGINE_EARLY_GAP`), engine warm-ups on one expert; 10: engine calls of
# at most `_CALL_BYTES` of weights
STRATEGY_SET_VERSION = 10
_CACHE_FORMAT = 1

# A candidate must beat stock by this factor (median of per-round ratios) to be chosen: noise alone then rarely
# picks a slower path, and a true gain below 3% is not worth the risk.
_MARGIN = 0.97
_MIN_ROUNDS = 3
_MAX_ROUNDS = 12
# Per calibration, after _MIN_ROUNDS: more rounds while it lasts, unless one candidate leads clearly. Close
# races may need them: capped to AVX2 on a Zen 4, torch's bf16 GEMV and layerswap's kernel time within 5-30% of
# each other at one row, -quant's engine measurement read the GEMV at 0.53-0.83 ms an expert from run to run,
# and one calibration on a 0.2 s budget chose the kernel there, 1.21x stock's time at T=1 (the GEMV: 1.03x).
_BUDGET_S = 0.3
# Candidates this much slower than the best (fastest calls) stop being timed: after the first round by the larger
# factor, after three by the smaller. On an AVX2-only Zen 3, torch's bf16 engines take 3-15x the kernel's time from
# 4 rows on (a weight-major call at 95 rows: 300 ms against 24), and timing each of them four times made a bf16
# shape's first call take 12 s.
_EARLY_DROP_FACTOR = 3.0
_DROP_FACTOR = 2.0
# An engine that leads the others by this factor after two rounds (its slower call against their faster ones) has
# won its row-count class: a class's timing then costs 3 calls per engine instead of 4. Engines only: a plan that
# beats stock must do so over at least `_MIN_ROUNDS` rounds, in the calibration of its bucket.
_ENGINE_EARLY_GAP = 1.25
# An engine this much slower than the best at one row count is not timed at the larger ones (its reference, the
# engine a tie keeps, always is).
_HOPELESS_FACTOR = 8.0
_CROSSOVER_ROWS = (2, 4, 8)
# The row count each class is timed at: 1, 2, 4, 8, then 23, 47, 95, inside the classes 16-31, 32-63 and 64+. A
# GEMM library tiles an exact multiple of its block (32 rows) better than the counts a layer routes: on Xeon-AMX
# fp32, -quant's weight-major GEMM took 0.82x nn.Linear's time at 32 rows and 0.98-1.08x at 41-49; capped to
# AVX2, 1.08x at 32 and 1.6-1.75x at 41-49. Timed at 32, it won a class it then lost in the layer.
_ENGINE_ROWS = tuple(1 << c if c < 4 else (3 << (c - 1)) - 1 for c in range(torch_moe.ROW_CLASSES))
_BLOCK_CHOICES = (1 << 20, 8 << 20)
_NEVER = 1 << 30  # min_rows that no expert reaches

_FLAGS_THAT_MATTER = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "avx_ne_convert",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
)
_REDUCED = (torch.bfloat16, torch.float16)
_CALIBRATED_DTYPES = (torch.float32, *_REDUCED)


@dataclass(frozen=True)
class CpuInfo:
    """What this CPU offers the kernels: model name, the SIMD/matrix flags that matter, torch's view of it."""

    model: str
    flags: tuple[str, ...]
    capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX2", "AVX512", ...
    logical_cores: int

    @property
    def amx(self) -> bool:
        return "amx_bf16" in self.flags

    @property
    def avx512_bf16(self) -> bool:
        return "avx512_bf16" in self.flags

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags

    def native_gemm(self, dtype: torch.dtype) -> bool:
        """Whether oneDNN has a reduced-precision GEMM in hardware for `dtype` here (else it emulates, slowly)."""
        if dtype == torch.bfloat16:
            return self.amx or self.avx512_bf16
        if dtype == torch.float16:
            return "amx_fp16" in self.flags or "avx512_fp16" in self.flags
        return True

    def summary(self) -> str:
        shown = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in self.flags]
        return f"{self.model} ({', '.join(shown) or 'no avx2'}; {self.logical_cores} cores)"


def _read_proc_cpuinfo() -> tuple[str, set[str]]:
    model, flags = "", set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
            if model and flags:
                break
    return model, flags


# Environment variables that cap the instructions torch's math libraries use, whatever the CPU offers: a cap
# changes which engine is fastest (oneDNN's bf16 GEMM capped at AVX2 runs 16x slower on an AMX Xeon), so a
# decision measured under one setting must not be read under another.
ISA_LIMIT_ENV = (
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "ATEN_CPU_CAPABILITY",
    "MKL_CBWR",
)

# oneDNN's ISA names (its dnnl_cpu_isa_t bit masks) and the mask each CPU flag needs: under a cap, oneDNN uses
# only the instructions whose bits the cap holds.
_ONEDNN_ISA_MASKS = {
    "SSE41": 0x1,
    "AVX": 0x3,
    "AVX2": 0x7,
    "AVX2_VNNI": 0xF,
    "AVX2_VNNI_2": 0x1F,
    "AVX512_CORE": 0x27,
    "AVX512_CORE_VNNI": 0x67,
    "AVX512_CORE_BF16": 0xE7,
    "AVX10_1_512": 0x1EF,
    "AVX512_CORE_FP16": 0x1EF,
    "AVX10_1_512_AMX": 0xFEF,
    "AVX512_CORE_AMX": 0xFEF,
    "AVX10_1_512_AMX_FP16": 0x1FEF,
    "AVX512_CORE_AMX_FP16": 0x1FEF,
}
_FLAG_ISA_MASKS = {
    **dict.fromkeys(("avx2", "fma", "f16c"), 0x7),
    "avx_vnni": 0xF,
    "avx_ne_convert": 0x1F,
    **dict.fromkeys(("avx512f", "avx512bw"), 0x27),
    "avx512_vnni": 0x67,
    "avx512_bf16": 0xE7,
    "avx512_fp16": 0x1EF,
    **dict.fromkeys(("amx_tile", "amx_bf16", "amx_int8"), 0xFEF),
    "amx_fp16": 0x1FEF,
}


def isa_limits() -> dict[str, str]:
    """The instruction-set caps set in the environment (`ISA_LIMIT_ENV`), by variable name."""
    return {name: os.environ[name] for name in ISA_LIMIT_ENV if os.environ.get(name, "").strip()}


def _onednn_allowed(flags: set[str]) -> set[str]:
    """`flags` less those oneDNN may not use under ONEDNN_MAX_CPU_ISA (or the older DNNL_MAX_CPU_ISA): capped
    at AVX2, an AMX CPU has no hardware bf16 GEMM. An unknown or absent cap leaves the flags as they are."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    mask = _ONEDNN_ISA_MASKS.get(cap)
    if mask is None:
        return flags
    return {flag for flag in flags if _FLAG_ISA_MASKS.get(flag, 0) & ~mask == 0}


@functools.cache
def cpu_info() -> CpuInfo:
    """This machine's CPU, read once from /proc/cpuinfo, with torch's own checks where that file is missing.
    Its flags are those oneDNN may use: a ONEDNN_MAX_CPU_ISA cap removes the ones above it."""
    model, flags = _read_proc_cpuinfo()
    if not flags:  # not Linux: ask torch, which checks the instructions its kernels use
        checks = (
            (("avx2",), "_is_avx2_supported"),
            (("avx512f",), "_is_avx512_supported"),
            (("avx512_bf16",), "_is_avx512_bf16_supported"),
            (("amx_tile", "amx_bf16"), "_is_amx_tile_supported"),
            (("amx_fp16",), "_is_amx_fp16_supported"),
        )
        for names, check in checks:
            with contextlib.suppress(Exception):
                if getattr(torch.cpu, check)():
                    flags.update(names)
    usable = _onednn_allowed(flags)
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # very old torch
        capability = "unknown"
    return CpuInfo(
        model=model or platform.processor() or platform.machine() or "unknown CPU",
        flags=tuple(f for f in _FLAGS_THAT_MATTER if f in usable),
        capability=capability,
        logical_cores=os.cpu_count() or 1,
    )


def machine_key() -> dict[str, Any]:
    """What a cached decision depends on besides its shape: the CPU, the torch and the code that measured it."""
    info = cpu_info()
    return {
        "cpu": info.model,
        "flags": list(info.flags),
        "capability": info.capability,
        "cores": info.logical_cores,
        "torch": torch.__version__,
        "strategies": STRATEGY_SET_VERSION,
        "kernel": cpu_native.identity(),
        "isa_limits": isa_limits(),
    }


def token_bucket(num_tokens: int) -> int:
    """The power of two at or above `num_tokens` (capped at 8192): calibrated and decided once per bucket."""
    return min(1 << max(0, num_tokens - 1).bit_length(), 8192)


# --- the cache --------------------------------------------------------------------------------------------------


@functools.cache
def _machine_digest() -> str:
    return hashlib.sha256(json.dumps(machine_key(), sort_keys=True).encode()).hexdigest()[:16]


def cache_path() -> Path:
    """The file holding this machine's decisions: one per machine key, so CPUs sharing a home never mix."""
    return cache_dir() / f"cpu-dispatch-{_machine_digest()}.json"


def _plan_to_json(plan: Plan, timings_ms: dict[str, float] | None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "strategy": plan.strategy,
        "min_rows": plan.min_rows,
        "block_bytes": plan.block_bytes,
        "ops": list(plan.ops),
        "workers": plan.workers,
    }
    if timings_ms:
        entry["median_ms"] = {name: round(ms, 4) for name, ms in timings_ms.items()}
    return entry


def _plan_from_json(entry: Any) -> Plan | None:
    try:
        ops, workers = tuple(entry.get("ops", ())), int(entry.get("workers", 1))
        return Plan(
            entry["strategy"],
            int(entry["min_rows"]),
            int(entry["block_bytes"]),
            ops,
            workers,
            source="cached",
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None  # an entry from another version or a damaged file: measured again


class PlanCache:
    """Decisions for one machine key: in memory, backed by one JSON file that several processes may share."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.plans: dict[str, Plan] = {}
        self.writable = True
        self._loaded = False

    def _read_file(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("format") != _CACHE_FORMAT:
            return {}
        plans = data.get("plans")
        return plans if isinstance(plans, dict) else {}

    def get(self, key: str) -> Plan | None:
        if not self._loaded:
            self._loaded = True
            for name, entry in self._read_file().items():
                plan = _plan_from_json(entry)
                if plan is not None:
                    self.plans.setdefault(name, plan)
        return self.plans.get(key)

    def put(
        self, key: str, plan: Plan, timings_ms: dict[str, float] | None = None, persist: bool = True
    ) -> None:
        """Remember `plan` for `key`; also on disk unless `persist` is False (a measurement taken while the
        machine was busy holds for this process only, and the next process measures again)."""
        self.plans[key] = plan
        if self.writable and persist:
            try:
                self._write(key, _plan_to_json(plan, timings_ms))
            except OSError as error:  # read-only home, full disk: keep the decision for this process only
                self.writable = False
                logger.debug(
                    "layerswap: CPU dispatch cache %s not writable (%s); in memory only", self.path, error
                )

    def _write(self, key: str, entry: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        plans = self._read_file()  # merge what other processes wrote since we read it
        plans[key] = entry
        data = {"format": _CACHE_FORMAT, "machine": machine_key(), "plans": plans}
        descriptor, temporary = tempfile.mkstemp(
            dir=self.path.parent, prefix=self.path.name + ".", suffix=".tmp"
        )
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                json.dump(data, handle, indent=1, sort_keys=True)
            os.replace(temporary, self.path)  # atomic: readers see the old file or the new one, never half
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise


_lock = threading.RLock()
_caches: dict[Path, PlanCache] = {}
# What the decision depends on; the cache directory only says where it is kept (clear_memory_cache() rereads).
_ENV_THAT_MATTERS = (ENV_STRATEGY, ENV_CALIBRATION)
_memo: dict[tuple, Plan] = {}
_linear_memo: dict[tuple, tuple[str, ...]] = {}  # linear_expert_ops' decisions


def _cache() -> PlanCache:
    path = cache_path()
    cache = _caches.get(path)
    if cache is None:
        cache = _caches[path] = PlanCache(path)
    return cache


def clear_memory_cache() -> None:
    """Forget every decision held in memory (the files stay); the next call reads or measures again."""
    with _lock:
        _caches.clear()
        _memo.clear()
        _linear_memo.clear()


# --- rules and forced plans -----------------------------------------------------------------------------------


def rule_plan(dtype: torch.dtype, info: CpuInfo | None = None) -> Plan:
    """The decision without measuring, from what the CPU offers: layerswap's per-expert path where oneDNN has
    the dtype in hardware (and for fp32), else weights converted to fp32 in cache."""
    info = info or cpu_info()
    if dtype in _REDUCED and not info.native_gemm(dtype):
        return Plan("upcast", source="rule")
    return Plan("layerswap", source="rule")


def forced_plan() -> Plan | None:
    """The plan LAYERSWAP_CPU_STRATEGY names, if set: "stock", "layerswap", "layerswap:<engine>[:<workers>]",
    "upcast" or "upcast:<min_rows>"."""
    text = os.environ.get(ENV_STRATEGY, "").strip()
    if not text:
        return None
    name, _, detail = text.partition(":")
    try:
        if detail and name == "layerswap":
            engine, _, workers = detail.partition(":")
            if engine == "skinny" and not cpu_native.available():
                raise ValueError(f"engine 'skinny' cannot run here: {cpu_native.why_unavailable()}")
            ops = (engine,) * torch_moe.ROW_CLASSES
            return Plan(name, ops=ops, workers=int(workers) if workers else 1, source="forced")
        if detail and name == "upcast":
            return Plan(name, min_rows=int(detail), source="forced")
        if detail:
            raise ValueError(f"{name!r} takes no ':' parameter")
        return Plan(name, source="forced")
    except ValueError as error:
        raise ValueError(
            f"{ENV_STRATEGY}={text!r}: {error}; expected one of {sorted(STRATEGIES)}, optionally "
            f"'layerswap:<engine>[:<workers>]' (an engine of {torch_moe.EXPERT_OPS}) or 'upcast:<rows>'"
        ) from None


def calibration_enabled() -> bool:
    return os.environ.get(ENV_CALIBRATION, "1").strip().lower() not in ("0", "false", "no", "off")


def _machine_busy() -> bool:
    """Whether other work competes for the cores (1-minute load average above 1.5 per core, this process's own
    threads included): calibrating then mostly measures the contention, which on a 2-4 core machine punishes
    every extra parallel op, so such a decision is not written to disk."""
    try:
        return os.getloadavg()[0] > 1.5 * cpu_info().logical_cores
    except OSError:  # not available on this platform
        return False


def _can_measure(*tensors: torch.Tensor) -> bool:
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" for t in tensors)


# --- calibration ------------------------------------------------------------------------------------------------


# Numbers every calibration call of this process, timed or warm-up, in order. A call runs on the experts its
# number picks (`_experts_of_call`), so consecutive calls, of any candidate and any calibration, read different
# experts' weights from memory: where two candidates of a round ran the same experts, the second found them in
# cache (this CPU's L3 holds 480 MiB, 50 Qwen3 experts), and a 2-expert calibration chose a plan that timed
# 1.0-1.6x stock's on the full layer.
_call_numbers = itertools.count()

# A calibration call: `call(round_index, call_number)`. Candidates of one round run the same problem (a paired
# comparison); the call number says on which experts.
Call = Callable[[int, int], object]


def _experts_of_call(call_number: int, footprint: int, num_experts: int) -> int:
    """The first of `footprint` consecutive experts (modulo `num_experts`) that call `call_number` runs: calls
    in a row walk through the layer, so an expert is read again only after all the others."""
    return (call_number * max(1, footprint % num_experts)) % num_experts


def _interleaved_ms(
    calls: dict[str, Call],
    min_rounds: int,
    max_rounds: int,
    budget_s: float,
    seed: int,
    until_clear: bool = False,
    early_gap: float = math.inf,
) -> dict[str, list[float]]:
    """Per-call ms of each candidate, taking turns in an order shuffled every round (one warm-up call first),
    for `min_rounds` rounds, then while `budget_s` lasts (up to `max_rounds`) or, with `until_clear`, until one
    candidate leads clearly (`_clear_leader`), or by the factor `early_gap` already after two rounds: where the
    decision is the fastest candidate, more rounds would then not change it, and they are spent only where
    candidates are close. Candidates whose fastest call is `_EARLY_DROP_FACTOR` slower than the best one after
    the first round, or `_DROP_FACTOR` slower after the third, are no longer timed, except "stock", the
    reference every decision is a ratio to."""
    for call in calls.values():
        call(0, next(_call_numbers))
    times: dict[str, list[float]] = {name: [] for name in calls}
    alive = list(calls)
    order = random.Random(seed)
    started = time.perf_counter()
    for round_index in range(max_rounds):
        order.shuffle(alive)
        for name in alive:
            call_number = next(_call_numbers)
            begin = time.perf_counter()
            calls[name](round_index + 1, call_number)
            times[name].append((time.perf_counter() - begin) * 1e3)
        if round_index in (0, 2):
            factor = _EARLY_DROP_FACTOR if round_index == 0 else _DROP_FACTOR
            best = min(min(times[n]) for n in alive)
            alive = [n for n in alive if n == "stock" or min(times[n]) <= factor * best]
        rounds = round_index + 1
        gap = 1.0 if rounds >= min_rounds else early_gap  # how clearly a leader must lead to stop now
        if until_clear and rounds >= 2 and _clear_leader(times, alive, gap):
            break
        if rounds >= min_rounds and time.perf_counter() - started > budget_s:
            break
    return times


def _clear_leader(times: dict[str, list[float]], alive: Sequence[str], gap: float) -> bool:
    """Whether one candidate's slowest call was `gap` times faster than every other candidate's fastest. Over 3
    rounds equal candidates order themselves so (gap 1) with a chance of 1 in 10 for two, far less for more,
    and the candidate that leads by chance then leads by little."""
    slowest = {name: max(times[name]) for name in alive}
    leader = min(slowest, key=slowest.__getitem__)
    return all(gap * slowest[leader] < min(times[name]) for name in alive if name != leader)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _random_rows(generator: torch.Generator, rows: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(rows, columns, generator=generator).to(dtype)


def _crossover_plan(
    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[Plan, dict[str, float]]:
    """For `upcast`: from how many rows converting an expert's weights to fp32 beats torch's own GEMM in the
    weights' dtype, and which conversion block size is faster, timed on single experts of this layer."""
    num_experts, _, hidden = gate_up_proj.shape
    generator = torch.Generator().manual_seed(0)
    inputs = {m: _random_rows(generator, m, hidden, gate_up_proj.dtype) for m in _CROSSOVER_ROWS}
    scratch = torch.empty(
        max(strategies.scratch_numel(gate_up_proj, down_proj, b) for b in _BLOCK_CHOICES), dtype=torch.float32
    )

    def direct(m: int) -> Call:
        return _on_next_expert(
            lambda e: strategies.grouped_expert_mlp(inputs[m], gate_up_proj, down_proj, e, act), num_experts
        )

    def converted(m: int, block: int) -> Call:
        out = torch.empty(m, hidden, dtype=torch.float32)

        def run(e: int) -> object:
            strategies.upcast_expert_mlp(inputs[m], gate_up_proj[e], down_proj[e], act, out, scratch, block)
            return out

        return _on_next_expert(run, num_experts)

    calls: dict[str, Call] = {}
    for m in _CROSSOVER_ROWS:
        calls[f"direct@{m}"] = direct(m)
        for block in _BLOCK_CHOICES:
            calls[f"upcast@{m}/{block >> 10}K"] = converted(m, block)
    with torch.no_grad():
        times = _interleaved_ms(calls, _MIN_ROUNDS, _MAX_ROUNDS, _BUDGET_S, seed=1)
    medians = {name: _median(t) for name, t in times.items() if t}

    def upcast_ms(m: int, block: int) -> float:
        return medians.get(f"upcast@{m}/{block >> 10}K", math.inf)

    block = min(_BLOCK_CHOICES, key=lambda b: sum(upcast_ms(m, b) for m in _CROSSOVER_ROWS))
    gain = [(m, medians[f"direct@{m}"] - upcast_ms(m, block)) for m in _CROSSOVER_ROWS]
    min_rows = _NEVER
    for (m_lo, gain_lo), (m_hi, gain_hi) in zip([(1, -math.inf), *gain], gain, strict=False):
        if gain_hi > 0:  # converting wins at m_hi: the crossover lies in (m_lo, m_hi]
            if math.isinf(gain_lo):
                min_rows = m_hi
            else:
                min_rows = m_lo + max(1, math.ceil((m_hi - m_lo) * -gain_lo / (gain_hi - gain_lo)))
            break
    else:
        # Converting lost everywhere measured: extrapolate the two largest row counts' trend, if it closes.
        (m_lo, gain_lo), (m_hi, gain_hi) = gain[-2], gain[-1]
        slope = (gain_hi - gain_lo) / (m_hi - m_lo)
        if slope > 0:
            min_rows = min(_NEVER, m_hi + math.ceil(-gain_hi / slope))
            min_rows = min_rows if min_rows <= 64 else _NEVER
    return Plan("upcast", min_rows=min_rows, block_bytes=block, source="calibrated"), medians


def _on_next_expert(run: Callable[[int], object], num_experts: int) -> Call:
    """A calibration call of `run(expert)` on the expert its call number picks."""
    return lambda _, call_number: run(_experts_of_call(call_number, 1, num_experts))


def _on_next_experts(run: Callable[[Sequence[int]], object], group: int, num_experts: int) -> Call:
    """A calibration call of `run(experts)` on the `group` consecutive experts its call number picks; the
    untimed warm-up call (round 0) on the first of them only: it compiles and allocates for the row count as
    well, at a fraction of the cost."""

    def call(round_index: int, call_number: int) -> object:
        first = _experts_of_call(call_number, group, num_experts)
        return run([(first + j) % num_experts for j in range(group if round_index else 1)])

    return call


def _worth_timing(op: str, rows: int, dtype: torch.dtype) -> bool:
    """Whether engine `op` is a candidate for experts with `rows` rows of `dtype`. layerswap's kernel is timed at
    every row count: past 8 rows oneDNN's AMX or blocked GEMMs beat it by 1.3-1.5x on a Sapphire Rapids, but on an
    AVX2-only Zen 3 it ran a whole Qwen3-30B-A3B fp32 layer at T=512 (~32 rows an expert) in 0.70x stock's time,
    where MKL's x @ W.T (stock's GEMM) reached 62 GFLOP/s at 32 rows against its 93."""
    if op == "mv":
        return rows == 1  # more rows run as "row", timed anyway
    if op == "skinny":
        return dtype in torch_moe.SKINNY_DTYPES and cpu_native.available()
    return True


# engine(op, rows, m): a function that runs the experts it is given on engine `op` as the layer runs them (one
# call for the engines that batch experts, a call per expert for the others), expert j on rows[j * m:(j + 1) * m].
Engine = Callable[[str, torch.Tensor, int], Callable[[Sequence[int]], object]]


# At most this many bytes of weights an engine-calibration call (but one expert): a Qwen1.5-MoE-A2.7B fp32 expert
# holds 35 MB, and with 4 of them a call that shape's first call took 0.73-1.02 s on EPYC-AVX512, its engine timing
# 0.64 s (0.46-0.49 s with one a call, the same plans). How much of a batched engine's per-call saving one expert a
# call leaves uncredited at that size was not measured.
_CALL_BYTES = 64 << 20


def _experts_per_call(rows: int, num_experts: int, expert_bytes: int) -> int:
    """How many experts of `rows` rows one engine-calibration call runs: up to 4, about 32 rows and
    `_CALL_BYTES` in all. Timed one expert a call, what the batched engines ("grouped", "skinny": one call for
    all of a layer's experts) save per expert went uncredited: with Qwen3-30B-A3B shapes (fp32, Xeon-AMX, T=16)
    -quant kept three GEMVs per one-row expert, 1.11x stock, where the kernel's one call took 0.96x in a
    separate harness. Each call costs its experts' time, and calibration runs at least 4 calls per candidate: on
    EPYC-AVX512 (Qwen3-30B-A3B fp32) a shape's first call, which measures the engines on 1 and 2 threads and its
    bucket, took 1.05 s timed one expert a call, 2.7-2.9 s with 8 a call, 1.6-1.7 s with 4."""
    return max(1, min(4, num_experts, 32 // rows, _CALL_BYTES // max(1, expert_bytes)))


def _fastest_engines(
    ops: Sequence[str],
    reference: str,
    engine: Engine,
    num_experts: int,
    hidden: int,
    dtype: torch.dtype,
    expert_bytes: int,
) -> tuple[tuple[str, ...], dict[str, float]]:
    """The fastest of `ops` at each row-count class (1, 2-3, 4-7, ... 64+ rows; timed at `_ENGINE_ROWS` rows),
    timed interleaved on a few experts of the layer per call (`_experts_per_call`), run as the layer runs them
    (`engine`); each call runs the experts after those of the call before it, whose weights come from memory,
    none from a warm cache. `reference` is kept unless another engine beats it by the margin. The medians are
    ms per expert."""
    generator = torch.Generator().manual_seed(0)
    chosen, medians, hopeless = [], {}, set()
    with torch.no_grad():
        for m in _ENGINE_ROWS:
            group = _experts_per_call(m, num_experts, expert_bytes)
            rows = _random_rows(generator, group * m, hidden, dtype)
            candidates = [
                op for op in ops if _worth_timing(op, m, dtype) and (op == reference or op not in hopeless)
            ]
            calls = {
                f"{op}@{m}": _on_next_experts(engine(op, rows, m), group, num_experts) for op in candidates
            }
            times = _interleaved_ms(
                calls,
                _MIN_ROUNDS,
                _MAX_ROUNDS,
                _BUDGET_S / len(_ENGINE_ROWS),
                seed=m,
                until_clear=True,
                early_gap=_ENGINE_EARLY_GAP,
            )
            timed = {name.partition("@")[0]: _median(t) / group for name, t in times.items() if t}
            medians.update({f"{op}@{m}": ms for op, ms in timed.items()})
            best = min(timed, key=timed.__getitem__)
            hopeless.update(op for op, ms in timed.items() if ms > _HOPELESS_FACTOR * timed[best])
            if reference in timed and timed[best] > _MARGIN * timed[reference]:
                best = reference
            chosen.append(best)
    return tuple(chosen), medians


def _engines_plan(
    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[Plan, dict[str, float]]:
    """For `layerswap`: the engine that runs the experts of each row-count class fastest, timed on experts of
    this layer run as `layerswap` runs them. The grouped GEMM (stock's) is kept unless another engine beats it
    by the margin: on a tie it saves Python dispatches."""
    num_experts, _, hidden = gate_up_proj.shape
    grouped = torch_moe._CPU_GROUPED_MM
    ops = tuple(op for op in torch_moe.EXPERT_OPS if grouped or op != "grouped")

    def engine(op: str, rows: torch.Tensor, m: int) -> Callable[[Sequence[int]], object]:
        every_class = (op,) * torch_moe.ROW_CLASSES

        def run(experts: Sequence[int]) -> object:
            sizes = [0] * (num_experts + 1)  # the last: the layer's "not on this rank" pairs, none here
            for e in experts:
                sizes[e] = m
            return torch_moe._all_experts(rows, gate_up_proj, down_proj, act, sizes, False, every_class)

        return run

    expert_bytes = (gate_up_proj[0].numel() + down_proj[0].numel()) * gate_up_proj.element_size()
    chosen, medians = _fastest_engines(
        ops, "grouped", engine, num_experts, hidden, gate_up_proj.dtype, expert_bytes
    )
    return Plan("layerswap", ops=chosen, source="calibrated"), medians


def _engines(
    cache: PlanCache,
    shape_key: str,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> Plan:
    """The cached or newly measured engines of `layerswap`, measured in this thread."""
    key = f"{shape_key}|engines"
    plan = cache.get(key)
    if plan is None:
        plan, medians = _engines_plan(gate_up_proj, down_proj, act)
        cache.put(key, plan, medians, persist=not _machine_busy())
    return plan


def _calibration_problem(
    generator: torch.Generator,
    bucket: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    dtype: torch.dtype,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A router's choices for `bucket` tokens, kept only for the first `window` experts, each kept (token,
    expert) pair as its own token (top_k 1): the experts see exactly the row counts they would. A call shifts
    the experts to those its call number picks (`_experts_of_call`)."""
    chosen = (
        torch.rand(bucket, num_experts, generator=generator).topk(min(top_k, num_experts), dim=-1).indices
    )
    experts = chosen.reshape(-1)
    experts = experts[experts < window]
    if experts.numel() == 0:
        experts = torch.zeros(1, dtype=torch.long)
    index = experts[:, None]
    return (
        _random_rows(generator, index.shape[0], hidden, dtype),
        index,
        torch.rand(index.shape, generator=generator).to(dtype),
    )


def _window(bucket: int, num_experts: int, top_k: int) -> int:
    """How many experts a calibration round covers: all of them at decode, else about 8 active experts and
    at most ~256 rows of work, so that a round stays in the tens of milliseconds. Fewer misjudge the layer:
    stock's fixed costs weigh more on a small slice (Qwen3-30B-A3B bf16 at T=512 on EPYC-AVX512: 1.55-1.95 ms
    per expert on 2 experts of ~32 rows, 1.34 ms on the whole layer), and with a 2-expert slice the calibration
    picked layerswap, 1.08-1.10x stock's time on the whole layer, where 8 experts pick stock."""
    k = min(top_k, num_experts)
    expected_active = num_experts * (1 - (1 - k / num_experts) ** bucket)
    rows_per_expert = bucket * k / num_experts
    by_active = math.ceil(num_experts * 8 / max(expected_active, 1e-9))
    by_rows = math.ceil(256 / max(rows_per_expert, 1.0))
    return max(1, min(num_experts, by_active, by_rows))


def _calibrate_bucket(
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    top_k: int,
    bucket: int,
    candidates: Sequence[Plan],
) -> tuple[Plan, dict[str, float]]:
    num_experts, _, hidden = gate_up_proj.shape
    dtype = gate_up_proj.dtype
    window = _window(bucket, num_experts, top_k)
    generator = torch.Generator().manual_seed(bucket)
    problems = [
        _calibration_problem(generator, bucket, num_experts, top_k, hidden, dtype, window)
        for _ in range(_MAX_ROUNDS + 1)
    ]
    by_name = {plan.label: plan for plan in candidates}

    def call(plan: Plan) -> Call:
        run = STRATEGIES[plan.strategy]

        def one(round_index: int, call_number: int) -> object:
            rows, experts, weights = problems[round_index]
            experts = (experts + _experts_of_call(call_number, window, num_experts)) % num_experts
            return run(rows, gate_up_proj, down_proj, experts, weights, act, plan)

        return one

    with torch.no_grad():
        times = _interleaved_ms(
            {n: call(p) for n, p in by_name.items()},
            _MIN_ROUNDS,
            _MAX_ROUNDS,
            _BUDGET_S,
            bucket,
            until_clear=True,
        )
    medians = {name: _median(t) for name, t in times.items() if t}
    stock_times = times["stock"]
    best, best_ratio = "stock", 1.0
    for name, values in times.items():
        if name == "stock" or not values:
            continue
        # Two estimates that noise moves differently, and the candidate must win by both: the median of its
        # ratios to stock's call of the same round (load that hits a round hits both), and the ratio of the
        # fastest calls (what is left when the load comes in spikes, as on a shared machine).
        paired = _median([t / s for t, s in zip(values, stock_times, strict=False)])
        ratio = max(paired, min(values) / min(stock_times[: len(values)]))
        if ratio < best_ratio:
            best, best_ratio = name, ratio
    if best_ratio > _MARGIN:
        best = "stock"
    chosen = by_name[best]
    return replace(chosen, source="calibrated"), medians


def fp32_matmul_mode() -> str:
    """How torch runs fp32 matmuls on the CPU: "none" (in fp32) or the reduced precision oneDNN may use instead
    ("bf16" after `torch.set_float32_matmul_precision("medium")`, "tf32"). It reorders the engines: on an AMX
    Xeon, "bf16" makes an fp32 `x @ W.T` 2.5x faster and then faster than the weight-major GEMM, which is 1.5x
    faster in fp32. So fp32 decisions are measured and cached per mode."""
    mode = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", None)
    if isinstance(mode, str):
        return mode
    try:  # torch before the per-backend setting
        return torch.get_float32_matmul_precision()
    except Exception:
        return "unknown"


def _shape_key(dtype: torch.dtype, num_experts: int, top_k: int, hidden: int, intermediate: int) -> str:
    name = str(dtype).removeprefix("torch.")
    key = f"{name}|E{num_experts}|K{top_k}|H{hidden}|I{intermediate}|threads{torch.get_num_threads()}"
    mode = _matmul_mode(dtype)
    return key if mode in ("none", "highest") else f"{key}|fp32-{mode}"


def _matmul_mode(dtype: torch.dtype) -> str:
    """What a decision for `dtype` depends on of torch's matmul settings: the fp32 precision, for fp32 only."""
    return fp32_matmul_mode() if dtype == torch.float32 else "none"


def plan_for(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    activation: Activation = "silu",
) -> Plan:
    """The plan a no-grad CPU `fused_moe` call with these tensors runs (measuring it now if it is the first)."""
    # Every call of every MoE layer comes here: a dict lookup decides, once the environment and shape are known.
    memo_key = (
        tuple(os.environ.get(name) for name in _ENV_THAT_MATTERS),
        gate_up_proj.dtype,
        tuple(gate_up_proj.shape),
        down_proj.shape[2],
        top_k_index.shape[-1],
        token_bucket(hidden_states.shape[0]),
        torch.get_num_threads(),
        _matmul_mode(gate_up_proj.dtype),
    )
    plan = _memo.get(memo_key)
    if plan is None:
        plan = _plan_for(hidden_states, gate_up_proj, down_proj, top_k_index, activation)
        if plan.source != "rule" or not calibration_enabled():  # a rule stands in until a measurement can run
            _memo[memo_key] = plan
    return plan


def _plan_for(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    activation: Activation,
) -> Plan:
    forced = forced_plan()
    if forced is not None:
        return forced
    dtype = gate_up_proj.dtype
    if dtype not in _CALIBRATED_DTYPES or not calibration_enabled():
        return rule_plan(dtype)
    num_experts, _, hidden = gate_up_proj.shape
    top_k = top_k_index.shape[-1]
    bucket = token_bucket(hidden_states.shape[0])
    shape_key = _shape_key(dtype, num_experts, top_k, hidden, down_proj.shape[2])
    key = f"{shape_key}|T{bucket}"
    with _lock:
        cache = _cache()
        plan = cache.get(key)
        if plan is not None:
            return plan
        if not _can_measure(hidden_states, gate_up_proj, down_proj, top_k_index):
            return rule_plan(dtype)
        act = resolve_activation(activation)
        engines = _engines(cache, shape_key, gate_up_proj, down_proj, act)
        candidates = [Plan("stock"), engines]
        threads = torch.get_num_threads()
        if threads > 1:  # whole experts per core, one thread each, instead of every GEMM split over the cores
            # With the engines measured in this thread: measuring them again on a worker made a shape's first
            # call 1.7-1.9x as long (EPYC-AVX512: 1.15 s against 0.68 in bf16, 1.62 against 0.87 in fp32), for
            # a candidate that lost every bucket there.
            candidates.append(replace(engines, workers=threads))
        if dtype in _REDUCED:
            crossover_key = f"{shape_key}|crossover"
            crossover = cache.get(crossover_key)
            if crossover is None:
                crossover, crossover_ms = _crossover_plan(gate_up_proj, down_proj, act)
                cache.put(crossover_key, crossover, crossover_ms, persist=not _machine_busy())
            if crossover.min_rows < _NEVER:
                candidates.append(crossover)
        plan, medians = _calibrate_bucket(gate_up_proj, down_proj, act, top_k, bucket, candidates)
        logger.debug("layerswap: CPU plan for %s: %s (median ms %s)", key, plan.describe(), medians)
        cache.put(key, plan, medians, persist=not _machine_busy())
        return plan


# --- experts held as separate projections (-quant) ---------------------------------------------------------------

# Expert weights as (gate or None, up, down), [I, H], [I, H], [H, I], one tuple per expert.
ExpertWeights = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]
ALL_ROW = ("row",) * torch_moe.ROW_CLASSES  # what nn.Linear itself runs, at every row count


def linear_expert_ops(
    dtype: torch.dtype,
    shape: tuple[int, int, int, bool],
    experts: Callable[[], Sequence[ExpertWeights]],
    act: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[str, ...]:
    """The engine (`torch_moe.LINEAR_EXPERT_OPS`) per row-count class for a no-grad CPU call of experts held as
    separate plain projections (`-quant`'s nn.Linear experts), given every such expert of the layer: measured
    once per shape (num_experts, hidden, intermediate, has_gate) and machine like the fused experts' engines
    (`experts` is only called to measure), with what nn.Linear itself runs (`x @ W.T`,
    "row") kept unless another engine beats it by the margin, so the worst case is nn.Linear's own speed.
    All "row" where calibration is off, a strategy other than `layerswap` is forced, or nothing can be measured;
    `LAYERSWAP_CPU_STRATEGY=layerswap:<engine>` forces that engine ("grouped" runs as "row")."""
    memo_key = (
        tuple(os.environ.get(name) for name in _ENV_THAT_MATTERS),
        dtype,
        shape,
        torch.get_num_threads(),
        _matmul_mode(dtype),
    )
    ops = _linear_memo.get(memo_key)
    if ops is None:
        ops, final = _linear_expert_ops(dtype, experts, act)
        if final:  # "row" stands in until a measurement can run
            _linear_memo[memo_key] = ops
    return ops


def _linear_expert_ops(
    dtype: torch.dtype,
    weights: Callable[[], Sequence[ExpertWeights]],
    act: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[tuple[str, ...], bool]:
    """The engines, and whether that is the decision for this process (False: ask again next call)."""
    forced = forced_plan()
    if forced is not None:
        if forced.strategy != "layerswap":
            return ALL_ROW, True
        ops = forced.ops or torch_moe.default_ops(dtype)
        return tuple(op if op in torch_moe.LINEAR_EXPERT_OPS else "row" for op in ops), True
    if dtype not in _CALIBRATED_DTYPES or not calibration_enabled():
        return ALL_ROW, True
    experts = weights()
    if (
        not experts
    ):  # this layer's experts are all quantized or observed: nothing to measure here, maybe elsewhere
        return ALL_ROW, False
    gate, up, _ = experts[0]
    intermediate, hidden = up.shape
    if not _can_measure(*(t for projections in experts for t in projections if t is not None)):
        return ALL_ROW, False
    suffix = "" if gate is not None else "-nogate"
    key = f"{_shape_key(dtype, len(experts), 0, hidden, intermediate)}|linear-engines{suffix}"
    with _lock:
        cache = _cache()
        plan = cache.get(key)
        if plan is None:

            def engine(op: str, rows: torch.Tensor, m: int) -> Callable[[Sequence[int]], object]:
                def run(chosen: Sequence[int]) -> object:  # as LinearExperts.forward runs them
                    weights = [experts[e] for e in chosen]
                    bounds = [bound for j in range(len(chosen)) for bound in (j * m, (j + 1) * m)]
                    if op == "skinny" and torch_moe.batches_on_kernel(rows, weights[0], act):
                        out = torch_moe.linear_experts_on_kernel(
                            rows, weights, bounds, torch.empty_like(rows)
                        )
                        pieces = [out[bounds[2 * j] : bounds[2 * j + 1]] for j in range(len(chosen))]
                    else:
                        pieces = [
                            torch_moe.linear_expert_mlp(rows[bounds[2 * j] : bounds[2 * j + 1]], *w, act, op)
                            for j, w in enumerate(weights)
                        ]
                    # The layer concatenates the outputs: this copies a weight-major engine's transposed output,
                    # part of its cost (bf16 on Xeon-AMX, 23-47 rows: 0.80-0.95x nn.Linear's time alone,
                    # 0.83-0.88x with the layer's concatenate, weight and sum).
                    return torch.cat(pieces)

                return run

            expert_bytes = sum(t.numel() * t.element_size() for t in experts[0] if t is not None)
            ops, medians = _fastest_engines(
                torch_moe.LINEAR_EXPERT_OPS, "row", engine, len(experts), hidden, dtype, expert_bytes
            )
            plan = Plan("layerswap", ops=ops, source="calibrated")
            logger.debug("layerswap: CPU engines for %s: %s (median ms %s)", key, ops, medians)
            cache.put(key, plan, medians, persist=not _machine_busy())
        return plan.ops, True


def cpu_fused_moe(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    activation: Activation = "silu",
) -> torch.Tensor:
    """The no-grad CPU experts forward, by the plan this machine measured for this dtype, bucket and shape."""
    if hidden_states.shape[0] == 0 or gate_up_proj.shape[0] == 0:
        return fused_moe_reference(
            hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, activation=activation
        )
    plan = plan_for(hidden_states, gate_up_proj, down_proj, top_k_index, activation)
    run = STRATEGIES[plan.strategy]
    return run(
        hidden_states,
        gate_up_proj,
        down_proj,
        top_k_index,
        top_k_weights,
        resolve_activation(activation),
        plan,
    )
