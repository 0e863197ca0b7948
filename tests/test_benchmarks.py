"""The benchmark scripts run: a smallest sweep of each suite cheap enough for CI."""

import csv

import pytest
import torch

from benchmark_modules import benchmark_module
from layerswap import cli


def test_attention_benchmark_sweep_runs_and_reports_every_provider():
    attention = benchmark_module("bench_attention")
    rows = list(attention.sweep(("meta-llama/Llama-3.2-1B",), ("fp32",), (1,), repeats=3, working_set_mb=0))
    assert {(r["kernel"], r["provider"]) for r in rows} == {
        ("qkv_proj", "stock"),
        ("qkv_proj", "fused"),
        ("qkv_proj", "fused/stock"),
        ("qkv_proj", "roofline"),
        ("attention", "stock"),
        ("attention", "fused"),
        ("attention", "fused/stock"),
    }
    assert all(r["median"] > 0 and r["p20"] <= r["median"] <= r["p80"] for r in rows)


def test_layerswap_bench_writes_a_csv_with_versions_and_a_plot(tmp_path):
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "--", "--suite", "memory", "--out", str(tmp_path)])
    assert done.value.code == 0
    with (tmp_path / "results.csv").open() as handle:
        rows = list(csv.DictReader(handle))
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


def test_layerswap_bench_on_cuda_without_a_gpu_says_so_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "--", "--suite", "moe", "--device", "cuda", "--out", str(tmp_path)])
    assert done.value.code == 2
    assert "no CUDA device is present" in capsys.readouterr().err
