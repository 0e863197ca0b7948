"""The benchmark scripts run: a smallest sweep of each suite cheap enough for CI."""

from benchmark_modules import benchmark_module


def test_attention_benchmark_sweep_runs_and_reports_every_provider():
    attention = benchmark_module("bench_attention")
    rows = list(attention.sweep(("meta-llama/Llama-3.2-1B",), ("fp32",), (1,), repeats=3, working_set_mb=0))
    assert {(r["kernel"], r["provider"]) for r in rows} == {
        ("qkv_proj", "stock"), ("qkv_proj", "fused"), ("qkv_proj", "fused/stock"), ("qkv_proj", "roofline"),
        ("attention", "stock"), ("attention", "fused"), ("attention", "fused/stock"),
    }
    assert all(r["median"] > 0 and r["p20"] <= r["median"] <= r["p80"] for r in rows)
