"""layerswap's hand-written CPU kernel (`cpu_gemm.cpp`), built on this machine on first use.

`skinny_mm(x, w, out)` computes `out = x @ w.T` for bf16 or fp32 with a few rows of `x`, streaming the weight at
close to the memory's read bandwidth, where torch's bf16 engines reach 70-85% of it and MKL's fp32 GEMV on a
768-row projection 90-95% (the numbers are in cpu_gemm.cpp). It is one engine among those the CPU dispatch measures ("skinny" in `torch_moe.EXPERT_OPS`), so
it only runs where it measured faster.

The C++ source is compiled with torch's own extension builder (a C++ compiler and ninja) the first time a
process needs it, about 10 s once per machine, into `<cache dir>/kernels/<name>` (see `_cache.cache_dir`; a
temporary directory where that cannot be written), and loaded from there afterwards. The name carries a digest
of the source, torch's version and the Python version, so an edited kernel or a new torch builds anew.
Linux on x86-64 only (the kernel is AVX2/AVX-512 code, built for torch's OpenMP runtime). Where it cannot be
built (no compiler, another platform, LAYERSWAP_CPU_KERNEL=0), `available()` is False, `why_unavailable()`
says why, and the dispatch uses torch's engines.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ._cache import cache_dir

logger = logging.getLogger(__name__)

ENV_KERNEL = "LAYERSWAP_CPU_KERNEL"  # "0": never build or use the kernel
SOURCE = Path(__file__).with_name("cpu_gemm.cpp")

# The instruction sets the kernel is written for, best first (their numbers are the C++ side's).
ISAS = {"avx512_bf16": 2, "avx2": 1}


# ATEN_CPU_CAPABILITY caps torch's own CPU kernels (ATen's); it caps this one alike.
_ATEN_CAPS = {"default": (), "avx2": ("avx2",), "avx512": tuple(ISAS)}


class _Kernel:
    def __init__(self, namespace: object) -> None:
        self.skinny_mm: Callable[..., None] = namespace.skinny_mm
        self.skinny_silu_mlp: Callable[..., None] = namespace.skinny_silu_mlp
        self.skinny_silu_experts: Callable[..., None] = namespace.skinny_silu_experts
        cap = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
        allowed = _ATEN_CAPS.get(cap, tuple(ISAS))
        self.supported = tuple(
            isa for isa, number in ISAS.items() if isa in allowed and namespace.isa_supported(number)
        )


def _disabled() -> bool:
    return os.environ.get(ENV_KERNEL, "1").strip().lower() in ("0", "false", "no", "off")


def _platform_problem() -> str | None:
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it is x86-64 Linux code, and this is {sys.platform} on {platform.machine()}"
    if not torch.backends.openmp.is_available():
        return "this torch build has no OpenMP runtime for the kernel's threads"
    return None


def extension_name() -> str:
    """The extension's (and its ops namespace's) name: a digest of what the built library depends on."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), sys.version.encode()):
        digest.update(part)
    return f"layerswap_cpu_{digest.hexdigest()[:12]}"


def identity() -> str:
    """What decisions measured with the kernel depend on (the CPU dispatch's cache key): its name, or "off" where
    LAYERSWAP_CPU_KERNEL=0 turns it off. Neither builds anything."""
    return "off" if _disabled() else extension_name()


def _build_dir(name: str) -> Path:
    preferred = cache_dir() / "kernels" / name
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        probe = preferred / f".writable-{os.getpid()}"
        probe.touch()
        probe.unlink()
        return preferred
    except OSError:
        fallback = Path(tempfile.gettempdir()) / f"layerswap-{os.getuid()}" / "kernels" / name
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


_load_lock = threading.Lock()


@functools.cache
def _load() -> _Kernel | str:
    """The built kernel, or why there is none. Built (or loaded) once per process, by one thread: the expert
    workers' first calls come at once, and two concurrent builds made torch's extension loader rename the second
    library's ops (`<name>_v1`), so the kernel was missing, or built twice, depending on timing. Threads that
    miss this cache together take turns at the lock, and the later ones get the first one's result; once cached,
    a kernel call takes no lock."""
    with _load_lock:
        return _build_or_load()


def _forget() -> None:
    """Forget the loaded kernel (and why there is none), so that the next call decides again (tests)."""
    with _load_lock:
        _load.cache_clear()
        _build_or_load.cache_clear()


@functools.cache
def _build_or_load() -> _Kernel | str:
    if _disabled():
        return f"disabled by {ENV_KERNEL}=0"
    problem = _platform_problem()
    if problem:
        return problem
    name = extension_name()
    try:
        from torch.utils import cpp_extension

        directory = _build_dir(name)
        source = directory / SOURCE.name  # built from there, so the package itself may be read-only
        if not source.exists() or source.read_bytes() != SOURCE.read_bytes():
            staged = directory / f".{SOURCE.name}.{os.getpid()}"
            staged.write_bytes(SOURCE.read_bytes())
            os.replace(staged, source)  # atomic: a concurrent build never reads half a file
        if not (directory / f"{name}.so").exists():
            logger.info("layerswap: building its CPU kernel in %s (once per machine, ~10 s)", directory)
        # Builds under a lock file in `directory` (concurrent processes wait for one build), or loads the
        # library already built there.
        library = cpp_extension.load(
            name=name,
            sources=[str(source)],
            # -fopenmp compiles the kernel's OpenMP loop; no runtime is linked, so it runs on torch's.
            extra_cflags=["-O3", "-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
        # The ops' namespace is the library's name, which torch's loader versions (`_v1`) if this process
        # already loaded a different build under `name`.
        return _Kernel(getattr(torch.ops, Path(library).stem))
    except Exception as error:  # no compiler or ninja, a failed build: torch's engines remain
        reason = f"the build failed ({type(error).__name__}: {str(error).strip().splitlines()[-1][:300]})"
        logger.warning("layerswap: no CPU kernel, %s; using torch's engines", reason)
        return reason


def available() -> bool:
    """Whether the kernel is built and this CPU runs one of its instruction sets (within ATEN_CPU_CAPABILITY)."""
    kernel = _load()
    return isinstance(kernel, _Kernel) and bool(kernel.supported)


def why_unavailable() -> str | None:
    """None when `available()`, else the reason, for messages and reports."""
    kernel = _load()
    if isinstance(kernel, str):
        return kernel
    return None if kernel.supported else f"this CPU has none of {tuple(ISAS)}"


def supported_isas() -> tuple[str, ...]:
    """The kernel's instruction sets this CPU runs, best first; () where there is no kernel."""
    kernel = _load()
    return kernel.supported if isinstance(kernel, _Kernel) else ()


def _kernel_and_isa(isa: str | None) -> tuple[_Kernel, str]:
    kernel = _load()
    if not isinstance(kernel, _Kernel) or not kernel.supported:
        raise RuntimeError(f"layerswap's CPU kernel is not available: {why_unavailable()}")
    if isa is None:
        return kernel, kernel.supported[0]
    if isa not in kernel.supported:
        raise ValueError(f"isa must be one of this CPU's {kernel.supported}, got {isa!r}")
    return kernel, isa


def skinny_mm(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, isa: str | None = None
) -> torch.Tensor:
    """`x @ w.T` for bf16 or fp32 CPU tensors ([M, K] x [N, K] -> [M, N]), written into `out` when given; each
    tensor's last dimension contiguous. `isa`: one of `supported_isas()` (default the best). No autograd."""
    kernel, isa = _kernel_and_isa(isa)
    if out is None:
        out = x.new_empty(x.shape[0], w.shape[0])
    kernel.skinny_mm(x, w, out, ISAS[isa])
    return out


def skinny_silu_mlp(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    out: torch.Tensor | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """`down(silu(gate(x)) * up(x))`, an expert's gated MLP ([M, H]; gate, up [I, H]; down [H, I]; no bias), in one
    call: gate and up are read in one pass and the SiLU product formed from their fp32 sums. bf16 or fp32, as
    `skinny_mm`."""
    kernel, isa = _kernel_and_isa(isa)
    if out is None:
        out = x.new_empty(x.shape[0], down.shape[0])
    kernel.skinny_silu_mlp(x, gate, up, down, out, ISAS[isa])
    return out


def skinny_silu_experts(
    x: torch.Tensor,
    gates: Sequence[torch.Tensor],
    ups: Sequence[torch.Tensor],
    downs: Sequence[torch.Tensor],
    bounds: Sequence[int],
    out: torch.Tensor,
    isa: str | None = None,
) -> torch.Tensor:
    """`skinny_silu_mlp` for several experts in one call: expert j (`gates[j]`, `ups[j]`, `downs[j]`) on rows
    `bounds[2j]:bounds[2j + 1]` of `x` ([S, H]), written to the same rows of `out`; other rows are left as they are.
    One call saves the Python work between experts (20-50 us each, 3-8% of a layer at 16 tokens)."""
    kernel, isa = _kernel_and_isa(isa)
    kernel.skinny_silu_experts(x, list(gates), list(ups), list(downs), list(bounds), out, ISAS[isa])
    return out
