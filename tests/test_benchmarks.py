"""The benchmark scripts run as a user runs them (as scripts of the checkout): a smallest sweep of each suite
cheap enough for CI. Tests only run them; they do not import their internals."""

import csv
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(script, *args, check=True):
    environment = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
    )
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def _rows(path):
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_attention_benchmark_sweep_runs_and_reports_every_provider(tmp_path):
    out = tmp_path / "attention.csv"
    _run(
        "bench_attention.py",
        "--csv",
        str(out),
        "--shapes",
        "meta-llama/Llama-3.2-1B",
        "--dtypes",
        "fp32",
        "--tokens",
        "1",
        "--repeats",
        "3",
        "--working-set-mb",
        "0",
    )
    rows = _rows(out)
    assert {(r["kernel"], r["provider"]) for r in rows} == {
        ("qkv_proj", "stock"),
        ("qkv_proj", "fused"),
        ("qkv_proj", "fused/stock"),
        ("qkv_proj", "roofline"),
        ("attention", "stock"),
        ("attention", "fused"),
        ("attention", "fused/stock"),
    }
    assert all(
        float(r["median"]) > 0 and float(r["p20"]) <= float(r["median"]) <= float(r["p80"]) for r in rows
    )


def test_the_benchmark_entry_point_writes_a_csv_with_versions_and_a_plot(tmp_path):
    _run("run.py", "--suite", "memory", "--out", str(tmp_path))
    rows = _rows(tmp_path / "results.csv")
    assert rows and set(rows[0]) >= {
        "kernel",
        "provider",
        "shape",
        "metric",
        "median",
        "p20",
        "p80",
        "device",
        "versions",
    }
    assert "transformers" in rows[0]["versions"]
    assert (tmp_path / "weight_footprint.png").stat().st_size > 0


def test_the_benchmark_entry_point_on_cuda_without_a_gpu_says_so_and_exits_2(tmp_path):
    done = _run(
        "run.py", "--suite", "moe", "--device", "cuda", "--out", str(tmp_path), check=False
    )  # the CPU wheel has no CUDA
    assert done.returncode == 2
    assert "no CUDA device is present" in done.stderr
