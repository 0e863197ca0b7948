"""The machine a benchmark ran on, in one place for every benchmark script: CSV columns and a plot label.

    from machine import machine_fields, machine_label
    row.update(machine_fields())    # cpu_model, cpu_flags, isa_limits, cpu_cores, threads, torch, transformers
    axes.set_title(f"... \n{machine_label()}")

A figure measured on one CPU says little about another (bf16 on an AMX Xeon and on an AVX2-only EPYC differ by
2-5x), so every row carries the CPU model, the flags that decide the kernels (amx, avx512_bf16, avx2), any
instruction-set cap set in the environment (ONEDNN_MAX_CPU_ISA=AVX2 makes an AMX Xeon's oneDNN an AVX2 one), the
core count and torch's thread count, and the versions of torch and transformers.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

try:
    import layerswap  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from layerswap.kernels import cpu_info
from layerswap.kernels.cpu_dispatch import isa_limits

# The columns every kernel benchmark's CSV starts with (bench_fused_moe.py adds "plan" and the machine columns).
KERNEL_FIELDS = ("kernel", "provider", "shape", "dtype", "T", "metric", "median", "p20", "p80", "device")
# The same columns in the combined results (run.py, bench_model.py), whose token column is named "tokens".
RESULT_FIELDS = tuple("tokens" if field == "T" else field for field in KERNEL_FIELDS)
MACHINE_FIELDS = ("cpu_model", "cpu_flags", "isa_limits", "cpu_cores", "threads", "torch", "transformers")
# The flags that decide which CPU kernels are fast, in the order they are reported.
KEY_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


@functools.cache
def _transformers_version() -> str:
    try:
        import transformers

        return transformers.__version__
    except ImportError:
        return "-"


def machine_fields() -> dict[str, str]:
    """CSV columns describing this machine and software, the same for every row of a run."""
    info = cpu_info()
    return {
        "cpu_model": info.model,
        "cpu_flags": " ".join(f for f in KEY_FLAGS if f in info.flags) or "-",
        "isa_limits": " ".join(f"{name}={value}" for name, value in isa_limits().items()) or "-",
        "cpu_cores": str(info.logical_cores),
        "threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "transformers": _transformers_version(),
    }


def machine_label() -> str:
    """One line for a plot: CPU model, key flags, cores and threads, torch and transformers versions."""
    fields = machine_fields()
    limits = "" if fields["isa_limits"] == "-" else f" capped by {fields['isa_limits']}"
    return (
        f"{fields['cpu_model']} [{fields['cpu_flags']}]{limits}, {fields['cpu_cores']} cores, "
        f"{fields['threads']} threads; torch {fields['torch']}, transformers {fields['transformers']}"
    )


def csv_path(out: str, default_name: str) -> Path:
    """Where a benchmark writes its CSV, settled before any timing starts: `out` itself, or `out/default_name`
    when `out` is a directory or ends with a slash (so pass --out as text: a Path drops the slash). Its folder is
    created here, so a path that cannot be written stops the run at once instead of after minutes of measuring."""
    folder = out.endswith(("/", os.sep)) or Path(out).is_dir()
    path = Path(out) / default_name if folder else Path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass
    except OSError as error:
        raise SystemExit(
            f"cannot write the results to {path}: {error}; pass --out with a writable path"
        ) from None
    return path
