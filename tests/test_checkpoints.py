"""A checkpoint saved in a layout only a bundle loads records that bundle in config.json; a load without it raises
naming it and the one-call loader, which loads it under the recorded bundles; stock-layout saves stay stock."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TorchAoConfig

import layerswap
from _support.bnb import quantization_config
from _support.checkpoints import assert_state_dicts_identical
from _support.numerics import assert_computed_close
from _support.tiny_models import tiny_input_ids, tiny_model

BUNDLE = "qwen2_moe-quant"


@pytest.fixture(scope="module")
def stock_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("stock")
    tiny_model("qwen2_moe").save_pretrained(directory)
    return directory


def _quantization(scheme):
    if scheme == "torchao":
        from torchao.quantization import Int8WeightOnlyConfig

        return TorchAoConfig(Int8WeightOnlyConfig())
    return quantization_config(scheme)


def _quantized_save(source, target, scheme, **options):
    """Load `source` quantized under the bundle and save it after the bundle is disabled (a save inside the block
    records the same)."""
    with layerswap.use_bundle(BUNDLE, **options):
        model = AutoModelForCausalLM.from_pretrained(source, quantization_config=_quantization(scheme))
    model.save_pretrained(target)  # before any forward: see tests/quantizers/test_bitsandbytes.py
    return model


def _config(directory):
    return json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize("scheme", ["int8", "nf4", "torchao"])
def test_a_quantized_save_records_the_bundle_and_the_model_config_stays_as_it_was(
    stock_checkpoint, tmp_path, scheme
):
    model = _quantized_save(stock_checkpoint, tmp_path, scheme)
    record = _config(tmp_path)["layerswap"]
    assert record["bundles"] == [BUNDLE] and record["options"] == {}
    assert record["version"] == layerswap.__version__
    assert "layerswap.from_pretrained" in record["note"]
    assert not hasattr(model.config, "layerswap")  # written for the save only
    assert layerswap.recorded_bundles(tmp_path) == {BUNDLE: {}}


def test_a_config_saved_on_its_own_records_what_its_quantized_model_needs(stock_checkpoint, tmp_path):
    # auto-round 0.16 writes the packed weights itself and config.json with config.save_pretrained alone: its
    # mixtral saves under the bundle (experts.N.w1 ...) then reloaded silently as NaN logits, with no record.
    with layerswap.use_bundle(BUNDLE):
        model = AutoModelForCausalLM.from_pretrained(
            stock_checkpoint, quantization_config=_quantization("int8")
        )
    model.config.save_pretrained(tmp_path)
    assert _config(tmp_path)["layerswap"]["bundles"] == [BUNDLE]
    assert not hasattr(model.config, "layerswap")  # written for the save only
    model.save_pretrained(tmp_path / "whole")  # the model's own save: the same record
    assert _config(tmp_path / "whole")["layerswap"] == _config(tmp_path)["layerswap"]
    # The config of an unquantized bundle model, or of a stock one, saves as stock's.
    with layerswap.use_bundle(BUNDLE):
        unquantized = AutoModelForCausalLM.from_pretrained(stock_checkpoint)
    for config, target in ((unquantized.config, "unquantized"), (tiny_model("qwen2_moe").config, "stock")):
        config.save_pretrained(tmp_path / target)
        assert "layerswap" not in _config(tmp_path / target)


def test_unwatch_puts_back_both_save_pretrained_methods():
    script = textwrap.dedent(
        """
        from transformers import PretrainedConfig, PreTrainedModel
        stock = PreTrainedModel.__dict__["save_pretrained"], PretrainedConfig.__dict__["save_pretrained"]
        import layerswap
        from layerswap._hf import records, saving
        # The model's save: the all-or-nothing sharded save (saving) around the recording one (records).
        model_save = PreTrainedModel.__dict__["save_pretrained"].__wrapped__
        wrapped = model_save, PretrainedConfig.__dict__["save_pretrained"]
        assert all(w is not s and w.__wrapped__ is s for w, s in zip(wrapped, stock))
        saving.unwatch()  # in the reverse order of layerswap's import
        records.unwatch()
        assert (PreTrainedModel.__dict__["save_pretrained"], PretrainedConfig.__dict__["save_pretrained"]) == stock
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_options_other_than_the_defaults_are_recorded_and_the_loader_uses_them(stock_checkpoint, tmp_path):
    # keep_unquantized=() quantizes the 1-wide shared_expert_gate too: reloaded with the default options it would be
    # a full-precision nn.Linear receiving int8 bytes and scales.
    model = _quantized_save(stock_checkpoint, tmp_path, "int8", keep_unquantized=())
    assert _config(tmp_path)["layerswap"]["options"] == {BUNDLE: {"keep_unquantized": []}}
    reloaded = layerswap.from_pretrained(AutoModelForCausalLM, tmp_path)
    assert layerswap.enabled_bundles() == ()
    assert type(reloaded.model.layers[0].mlp.shared_expert_gate).__name__ == "Linear8bitLt"
    assert_state_dicts_identical(model, reloaded)


@pytest.mark.parametrize("scheme", ["int8", "nf4", "torchao"])
def test_loading_a_recorded_checkpoint_without_the_bundle_raises_naming_it_and_the_loader(
    stock_checkpoint, tmp_path, scheme
):
    _quantized_save(stock_checkpoint, tmp_path, scheme)
    with pytest.raises(layerswap.CheckpointNeedsBundleError) as raised:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    message = str(raised.value)
    assert f"'{BUNDLE}'" in message and "layerswap.from_pretrained(Qwen2MoeForCausalLM" in message
    assert f"layerswap.use_bundle('{BUNDLE}')" in message
    # Another bundle in force instead of the recorded one is no better: the error still names the recorded one.
    with (
        layerswap.use_bundle("olmoe-quant"),
        pytest.raises(layerswap.CheckpointNeedsBundleError, match=BUNDLE),
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("scheme", ["int8", "nf4", "torchao"])
def test_the_loader_reloads_a_quantized_save_with_its_weights_and_outputs(stock_checkpoint, tmp_path, scheme):
    model = _quantized_save(stock_checkpoint, tmp_path, scheme)
    reloaded = layerswap.from_pretrained(AutoModelForCausalLM, tmp_path)
    assert layerswap.enabled_bundles() == ()  # enabled for the call only
    assert layerswap.report(reloaded).expert_quantized_share == 1.0
    saved, loaded = model.state_dict(), reloaded.state_dict()
    assert saved.keys() == loaded.keys()
    for key, value in saved.items():
        if (
            scheme != "torchao"
        ):  # torchao's tensor subclasses do not compare with torch.equal; outputs do below
            assert torch.equal(value, loaded[key]), key
    with torch.no_grad():
        assert_computed_close(reloaded(tiny_input_ids()).logits, model(tiny_input_ids()).logits)


def test_the_loader_enables_extra_bundles_for_a_stock_checkpoint_and_checks_its_arguments(stock_checkpoint):
    model = layerswap.from_pretrained(
        AutoModelForCausalLM, stock_checkpoint, bundles=[BUNDLE], quantization_config=_quantization("nf4")
    )
    assert layerswap.report(model).expert_quantized_share == 1.0
    assert layerswap.enabled_bundles() == ()
    stock = layerswap.from_pretrained(AutoModelForCausalLM, stock_checkpoint)  # no record: a plain load
    assert layerswap.report(stock).swapped == {}
    with pytest.raises(layerswap.BundleError, match=r"model class first.*AutoModelForCausalLM"):
        layerswap.from_pretrained(stock_checkpoint, AutoModelForCausalLM)


def test_an_unknown_or_malformed_record_is_a_clear_error_for_the_loader_and_a_warning_for_a_plain_load(
    stock_checkpoint, tmp_path
):
    model = AutoModelForCausalLM.from_pretrained(stock_checkpoint)
    model.config.layerswap = {"bundles": ["qwen9_moe-quant"], "version": "9.0"}
    model.save_pretrained(tmp_path / "unknown")
    with pytest.raises(
        layerswap.UnknownBundleError, match=r"records bundle 'qwen9_moe-quant'.*9\.0.*Upgrade"
    ):
        layerswap.from_pretrained(AutoModelForCausalLM, tmp_path / "unknown")
    model.config.layerswap = {"bundles": "qwen2_moe-quant"}
    model.save_pretrained(tmp_path / "malformed")
    with pytest.raises(layerswap.BundleError, match="'layerswap' entry layerswap did not write"):
        layerswap.from_pretrained(AutoModelForCausalLM, tmp_path / "malformed")
    with pytest.warns(layerswap.LayerswapWarning, match="Loading it as a stock checkpoint"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "malformed")


def test_an_unquantized_bundle_save_has_no_record_and_reloads_in_stock_transformers_bitwise(
    stock_checkpoint, tmp_path
):
    # A stock-layout save records nothing: stock transformers loads it, and a record would make
    # layerswap.from_pretrained enable a bundle the checkpoint does not need (on another machine, say).
    with layerswap.use_bundle(BUNDLE):
        model = AutoModelForCausalLM.from_pretrained(stock_checkpoint)
        model.save_pretrained(tmp_path)
    assert _config(tmp_path) == _config(stock_checkpoint)
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert_state_dicts_identical(AutoModelForCausalLM.from_pretrained(stock_checkpoint), reloaded)
    # A recorded model that no longer holds quantized layers (here: unquantized, with a record from a config.json)
    # saves the stock layout, without the record.
    model.config.layerswap = {"bundles": [BUNDLE]}
    model.save_pretrained(tmp_path / "again")
    assert "layerswap" not in _config(tmp_path / "again")
    assert model.config.layerswap == {"bundles": [BUNDLE]}


# Run without layerswap imported: what a user of plain transformers gets from these checkpoints.
_STOCK_LOAD = textwrap.dedent(
    """
    import json, re, sys
    import torch
    from transformers import AutoModelForCausalLM
    from safetensors.torch import save_file
    from transformers.utils import logging
    logging.set_verbosity_error()
    results = {}
    for name in sys.argv[1:]:
        model, info = AutoModelForCausalLM.from_pretrained(name, output_loading_info=True)
        experts = model.model.layers[0].mlp.experts
        results[name] = {
            "missing": sorted(info["missing_keys"]),
            # Per-expert weights only: transformers 5.15 also reports bitsandbytes' `experts.*_proj_format` keys.
            "unexpected": sum(re.search(r"\\.experts\\.\\d+\\..*weight$", k) is not None for k in info["unexpected_keys"]),
            "gate_up_dtype": str(experts.gate_up_proj.dtype),
        }
    # The last checkpoint's weights as loaded, to compare bitwise (torchao's tensor subclasses do not save here).
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(state, f"{name}.reloaded.safetensors")
    assert "layerswap" not in sys.modules
    print(json.dumps(results))
    """
)


def test_stock_transformers_loads_quantized_saves_wrongly_and_a_record_on_a_stock_layout_harmlessly(
    stock_checkpoint, tmp_path
):
    # What the error protects against: plain transformers (layerswap not imported) loads torchao's per-expert
    # int8 experts as missing (randomly initialised gate_up_proj, only a load report says so) and bitsandbytes'
    # int8 bytes as the experts' weights; both loads succeed. And a record in a stock-layout checkpoint's
    # config.json changes nothing in what plain transformers loads.
    _quantized_save(stock_checkpoint, tmp_path / "torchao", "torchao")
    _quantized_save(stock_checkpoint, tmp_path / "int8", "int8")
    recorded = tmp_path / "stock-with-record"
    model = AutoModelForCausalLM.from_pretrained(stock_checkpoint)
    model.config.layerswap = {"bundles": [BUNDLE], "options": {}, "version": layerswap.__version__}
    model.save_pretrained(recorded)
    assert _config(recorded)["layerswap"]["bundles"] == [BUNDLE]
    names = [str(tmp_path / "torchao"), str(tmp_path / "int8"), str(recorded)]
    result = subprocess.run(
        [sys.executable, "-c", _STOCK_LOAD, *names], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    torchao, int8, stock = (json.loads(result.stdout.strip().splitlines()[-1])[n] for n in names)
    assert "model.layers.0.mlp.experts.gate_up_proj" in torchao["missing"] and torchao["unexpected"] == 48
    assert int8["missing"] == [] and int8["gate_up_dtype"] == "torch.int8" and int8["unexpected"] == 48
    assert stock["missing"] == [] and stock["unexpected"] == 0
    reloaded = load_file(f"{recorded}.reloaded.safetensors")
    expected = model.state_dict()
    assert reloaded.keys() == expected.keys()
    assert all(torch.equal(reloaded[k], expected[k]) for k in expected)
