"""The MoE benchmark scripts run as a user runs them (scripts of the checkout, in a subprocess), at their
smallest sizes: every provider reports, and every CSV row names the machine."""

from __future__ import annotations

import math
import os
from pathlib import Path

from _support.benchmark_scripts import read_rows, run_script

MACHINE_COLUMNS = {"cpu_model", "cpu_flags", "isa_limits", "cpu_cores", "threads", "torch", "transformers"}


def test_fused_moe_benchmark_covers_quant_and_forced_strategies(tmp_path: Path) -> None:
    out = tmp_path / "moe.csv"
    providers = ["grouped_mm", "layerswap", "quant", "ls-stock", "ls-layerswap", "ls-upcast"]
    run_script(
        "bench_fused_moe.py",
        *("--shapes", "small", "--dtypes", "bfloat16", "--tokens", "1", "16"),
        *("--reps", "1", "--budget", "0", "--flush-mib", "0", "--out", str(out)),
        *("--providers", *providers),
    )
    rows = read_rows(out)
    assert all(set(row) >= MACHINE_COLUMNS and row["cpu_model"] for row in rows)
    ratios = {(r["provider"], r["T"]) for r in rows if r["metric"] == "ratio_vs_best_stock"}
    assert ratios == {(p, t) for p in providers for t in ("1", "16")}
    plans = {r["provider"]: r["plan"] for r in rows if r["metric"] == "latency_ms"}
    assert plans["layerswap"] != "-" and plans["quant"].startswith("engines(")  # -quant's measured engines
    assert plans["grouped_mm"] == "-"


# --out is settled before any timing: a directory gets the default file name inside it, and a path that cannot be
# written stops the run at once with the reason, not after minutes of measuring.
def test_benchmark_output_path_is_settled_before_timing(tmp_path: Path) -> None:
    small = ("--shapes", "small", "--dtypes", "float32", "--tokens", "1", "--providers", "grouped_mm")
    quick = ("--reps", "1", "--budget", "0", "--flush-mib", "0")
    run_script("bench_fused_moe.py", *small, *quick, "--out", str(tmp_path))
    assert read_rows(tmp_path / "fused_moe.csv")
    # A folder that does not exist yet, named with a trailing slash (argparse's Path would drop the slash).
    run_script("bench_fused_moe.py", *small, *quick, "--out", f"{tmp_path / 'new'}{os.sep}")
    assert read_rows(tmp_path / "new" / "fused_moe.csv")
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    done = run_script("bench_fused_moe.py", *small, *quick, "--out", str(blocked / "x.csv"), check=False)
    assert done.returncode != 0 and "cannot write the results to" in done.stderr
    assert "fused_moe sweep" not in done.stderr  # stopped before timing anything


def test_model_benchmark_reports_speed_and_memory_for_every_provider(tmp_path: Path) -> None:
    out = tmp_path / "model.csv"
    run_script(
        "bench_model.py",
        "--tiny",
        "--quick",
        "--prompt",
        "4",
        "--decode",
        "2",
        "--rounds",
        "1",
        "--out",
        str(out),
    )
    rows = read_rows(out)
    assert all(set(row) >= MACHINE_COLUMNS for row in rows)
    by_provider: dict[str, dict[str, float]] = {}
    for row in rows:
        by_provider.setdefault(row["provider"], {})[row["metric"]] = float(row["median"])
    # Every quantizer is installed in the test environment, so no provider may be skipped.
    assert set(by_provider) == {"stock", "quant", "quant+nf4", "quant+int8", "quant+torchao-int8", "fast"}
    for metrics in by_provider.values():
        assert metrics["prefill_tokens_per_s"] > 0 and metrics["decode_tokens_per_s"] > 0
        assert metrics["footprint_mib"] > 0
    assert by_provider["stock"]["decode_speedup_vs_stock"] == 1.0
    assert by_provider["stock"]["footprint_vs_stock"] == 1.0
    # nf4 stores the experts in 4 bits: smaller than stock's bf16 even on the tiny model.
    assert by_provider["quant+nf4"]["footprint_mib"] < by_provider["stock"]["footprint_mib"]
    assert not math.isnan(by_provider["quant"]["footprint_vs_stock"])
