"""The command line: list, inspect on published configs, demo, and the generated catalog doc."""

import json
from pathlib import Path

import pytest

from _support.transformers_support import every_bundle_supported
from layerswap import cli
from layerswap.shapes import model_shape

ROOT = Path(__file__).resolve().parents[1]


def test_list_prints_every_bundle(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "qwen2_moe-quant" in out and "mixtral-quant" in out


@every_bundle_supported()  # the doc is generated where no bundle is marked as needing a newer transformers
def test_docs_bundles_md_is_generated_from_the_registry(capsys):
    assert cli.main(["list", "--markdown"]) == 0
    table = capsys.readouterr().out
    doc = (ROOT / "docs" / "bundles.md").read_text()
    assert table.strip() in doc, "docs/bundles.md is stale: regenerate it with `layerswap list --markdown`"


@pytest.mark.parametrize(
    "model", ["Qwen/Qwen1.5-MoE-A2.7B", "Qwen/Qwen3-30B-A3B", "mistralai/Mixtral-8x7B-v0.1"]
)
def test_inspect_published_configs_on_meta(model, capsys):
    assert cli.main(["inspect", model]) == 0
    out = capsys.readouterr().out
    share_line = next(line for line in out.splitlines() if line.startswith("quantizable share"))
    stock, swapped = (float(v.rstrip("%")) for v in share_line.split()[-2:])
    assert stock < 20 and swapped > 95


def test_inspect_a_local_config(tmp_path, capsys):
    values = model_shape("allenai/OLMoE-1B-7B-0924")
    values["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(values))
    assert cli.main(["inspect", str(tmp_path), "--bundle", "olmoe-quant"]) == 0
    assert "OlmoeExperts x2" in capsys.readouterr().out


def test_inspect_unknown_model_is_a_clear_error(capsys):
    assert cli.main(["inspect", "no/such-model"]) == 2
    assert "model_shapes.json" in capsys.readouterr().err


def test_demo_runs_end_to_end(capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "qwen2_moe-quant + nf4" in out and "100%" in out and "bit-identical" in out


def test_bench_is_not_an_installed_command(capsys):
    # The benchmarks are scripts of a source checkout (python benchmarks/run.py), not part of the wheel.
    with pytest.raises(SystemExit) as done:
        cli.main(["bench"])
    assert done.value.code == 2
    assert "invalid choice: 'bench'" in capsys.readouterr().err


def test_every_error_class_is_public_and_a_bundle_error():
    import inspect

    import layerswap
    from layerswap import errors as _errors

    for name, value in vars(_errors).items():
        if inspect.isclass(value) and issubclass(value, Exception):
            assert getattr(layerswap, name) is value, f"layerswap.{name} is not exported"
            assert name in layerswap.__all__
            if value is layerswap.KernelInputError:
                # The kernels import nothing above them: their error is a ValueError of their own.
                assert issubclass(value, ValueError) and not issubclass(value, layerswap.BundleError)
            elif not issubclass(value, Warning):
                assert issubclass(value, layerswap.BundleError), f"{name} is not a BundleError"
