"""The benchmark scripts run as a user runs them (as scripts of the checkout): a smallest sweep of each suite
cheap enough for CI. Tests only run them; they do not import their internals."""

from _support.benchmark_scripts import read_rows, run_script


def test_attention_benchmark_sweep_runs_and_reports_every_provider(tmp_path):
    out = tmp_path / "attention.csv"
    run_script(
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
    rows = read_rows(out)
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
    run_script("run.py", "--suite", "memory", "--out", str(tmp_path))
    rows = read_rows(tmp_path / "results.csv")
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
    done = run_script(
        "run.py", "--suite", "moe", "--device", "cuda", "--out", str(tmp_path), check=False
    )  # the CPU wheel has no CUDA
    assert done.returncode == 2
    assert "no CUDA device is present" in done.stderr
