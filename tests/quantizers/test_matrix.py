"""The quantizer compatibility matrix, as tests: quantizer x family x (-quant bundle | stock).

With the bundle every expert linear is quantized and forward runs; stock transformers leaves the fused 3D experts
in full precision. docs/quantizers.md is the same matrix, written by tests/quantizers/write_doc.py; the last
test fails when the committed table no longer matches a fresh measurement.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, FineGrainedFP8Config
from transformers.quantizers import AutoHfQuantizer

import layerswap
from _support.numerics import assert_computed_close
from _support.tiny_models import tiny_config, tiny_input_ids, tiny_model
from layerswap.errors import IncompatibleQuantizerError
from quantizers import matrix

DOC = Path(__file__).resolve().parents[2] / "docs" / "quantizers.md"

# Every bitsandbytes scheme on every matrix family; the other quantizers on two layouts that differ most
# (qwen2_moe: shared expert and a 1-wide gate; deepseek_v3: MLA attention, group-routed experts), to keep the
# suite short. tests/quantizers/write_doc.py measures every family for every scheme.
TEST_FAMILIES = {
    "bnb-nf4": matrix.MATRIX_FAMILIES,
    "bnb-fp4": matrix.MATRIX_FAMILIES,
    "bnb-int8": matrix.MATRIX_FAMILIES,
    "torchao-int8wo": ("qwen2_moe", "deepseek_v3"),
    "quanto-int8": ("qwen2_moe", "deepseek_v3"),
    "hqq-linear": ("qwen2_moe",),
}
TEST_KEYS = [(scheme, family) for scheme, families in TEST_FAMILIES.items() for family in families]

# Stock loads whose forward fails on this CPU, and why (the bundle keeps that module unquantized, so its rows
# pass). Allowed, not required: bitsandbytes' 4-bit CPU path differs between CPUs with and without AVX512-BF16.
STOCK_FORWARD_FAILURES = {
    ("bnb-nf4", "qwen2_moe"): "N must be divisible by block_n",
    ("bnb-fp4", "qwen2_moe"): "N must be divisible by block_n",
    ("hqq-linear", "qwen2_moe"): "is invalid for input of size 0",
}

# Max relative errors, by weight bits. Tiny random models amplify quantization error; these bounds catch garbage
# (a random or mis-wired expert gives an expert-output error near 1.4), not accuracy regressions. Measured on
# (docs/quantizers.md): 4-bit logits <= 0.29, experts <= 0.29; 8-bit logits <= 0.10, experts <= 0.03.
LOGIT_BOUND = {4: 0.5, 8: 0.2}
EXPERT_BOUND = {4: 0.5, 8: 0.06}


def _test_id(key):
    return "-".join(key)


@pytest.mark.parametrize("bundle", [True, False], ids=["bundle", "stock"])
@pytest.mark.parametrize("key", TEST_KEYS, ids=_test_id)
def test_matrix_row(key, bundle):
    scheme = matrix.SCHEMES_BY_KEY[key[0]]
    m = matrix.measure(*key, bundle)
    assert m.load_error is None, m.load_error
    assert m.expert_layers == 48  # 2 layers x 8 experts x 3 projections: the counting itself is right
    if bundle:
        assert m.expert_layers_quantized == m.expert_layers, m
        assert m.forward_ok, m.forward_error
        assert m.expert_rel_error < EXPERT_BOUND[scheme.bits], m
    else:
        assert m.expert_layers_quantized == 0 and m.expert_share == 0.0, m
        expected_failure = STOCK_FORWARD_FAILURES.get(key)
        if not m.forward_ok:
            assert expected_failure and expected_failure in m.forward_error, m.forward_error
            return
        assert m.expert_rel_error < 1e-6, "stock experts are not quantized, so they compute exactly as before"
    assert m.max_rel_error < LOGIT_BOUND[scheme.bits], m


# Quantizers that quantize while loading, on checkpoints whose experts are fused 3D tensors: the bundle splits each
# into per-expert weights, and the quantizer's op receives every expert of a layer at once (granitemoe's stock
# layout is fused; the others are saved with save_original_format=False).
FUSED_LAYOUT_CASES = [("qwen2_moe", "fused"), ("mixtral", "fused"), ("granitemoe", "stock")]


@pytest.mark.parametrize(("family", "layout"), FUSED_LAYOUT_CASES, ids=lambda v: v)
@pytest.mark.parametrize("scheme", ["bnb-nf4", "bnb-int8", "torchao-int8wo", "quanto-int8"])
def test_fused_checkpoints_get_every_expert_quantized(scheme, family, layout):
    m = matrix.measure(scheme, family, True, layout)
    assert m.load_error is None, m.load_error
    assert m.expert_layers > 0 and m.expert_layers_quantized == m.expert_layers, m
    assert m.forward_ok, m.forward_error
    bits = matrix.SCHEMES_BY_KEY[scheme].bits
    assert m.expert_rel_error < EXPERT_BOUND[bits] and m.max_rel_error < LOGIT_BOUND[bits], m


@pytest.mark.parametrize("family", ["qwen2_moe", "granitemoe"])
def test_torchao_quantized_model_saves_and_reloads_with_the_bundle_exactly(family, tmp_path):
    scheme = matrix.SCHEMES_BY_KEY["torchao-int8wo"]
    with layerswap.use_bundle(f"{family}-quant"):
        model = AutoModelForCausalLM.from_pretrained(
            matrix.checkpoint(family).directory, quantization_config=scheme.build(family)
        )
        model.save_pretrained(tmp_path)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    total, quantized = matrix._count_expert_layers(reloaded, scheme.quantized_by_class)
    assert total > 0 and quantized == total
    ids = tiny_input_ids()
    with torch.no_grad():
        assert_computed_close(reloaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("scheme", TEST_FAMILIES)
def test_layerswap_report_counts_what_the_quantizer_did(scheme):
    m = matrix.measure(scheme, "qwen2_moe", True)
    assert m.load_error is None, m.load_error
    assert m.expert_share == pytest.approx(m.class_share) == 1.0, m


def test_hqq_config_cannot_quantize_on_load_in_this_transformers():
    """transformers 5.24's HqqHfQuantizer lacks get_quantize_ops, so from_pretrained(quantization_config=
    HqqConfig(...)) raises for any model; the matrix uses hqq's own HQQLinear instead. When this test fails,
    transformers has fixed it: measure HqqConfig in the matrix (hqq-config rows) like the other quantizers."""
    for bundle in (False, True):
        m = matrix.measure("hqq-config", "qwen2_moe", bundle)
        assert m.load_error is not None and m.load_error.startswith("NotImplementedError"), m
        assert "HQQ is not available yet" in m.load_error


# --- finegrained_fp8 is refused with a -quant bundle --------------------------------------------------------

FP8_ADVICE = r"disable the '-quant' bundle.*use a quantizer that targets nn\.Linear"


def test_finegrained_fp8_is_refused_where_layerswap_checks_and_says_what_to_do():
    # On load transformers calls preprocess_model before any weight arrives; without a GPU, on-the-fly FP8
    # quantization stops earlier (validate_environment), so the check is exercised here directly.
    quantizer = AutoHfQuantizer.from_config(FineGrainedFP8Config())
    with layerswap.use_bundle("qwen2_moe-quant"):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tiny_config("qwen2_moe"))
        with pytest.raises(IncompatibleQuantizerError, match=FP8_ADVICE) as raised:
            quantizer.preprocess_model(model)
    assert "model.layers.0.mlp.experts" in str(raised.value)


def test_finegrained_fp8_from_pretrained_with_bundle_is_refused():
    # dequantize=True is the path a pre-quantized FP8 checkpoint takes on a machine without a GPU.
    directory = matrix.checkpoint("qwen2_moe").directory
    with layerswap.use_bundle("qwen2_moe-quant"), pytest.raises(IncompatibleQuantizerError, match=FP8_ADVICE):
        AutoModelForCausalLM.from_pretrained(
            directory, quantization_config=FineGrainedFP8Config(dequantize=True)
        )


def test_finegrained_fp8_without_bundle_quantizes_the_stock_experts():
    quantizer = AutoHfQuantizer.from_config(FineGrainedFP8Config())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("qwen2_moe"))
    quantizer.preprocess_model(model)
    assert type(model.model.layers[0].mlp.experts).__name__ == "FP8Experts"


# --- docs/quantizers.md is the measured matrix -------------------------------------------------------------

REGENERATE = "regenerate it: python tests/quantizers/write_doc.py"


def _same(column, committed, fresh):
    if column in matrix.NUMERIC_COLUMNS and "-" not in (committed, fresh):
        # 3 significant digits in the table; bitsandbytes' CPU kernels differ slightly between CPU features.
        return math.isclose(float(committed), float(fresh), rel_tol=0.05, abs_tol=1e-4)
    return committed == fresh


def test_committed_quantizer_doc_matches_a_fresh_measurement():
    text = DOC.read_text()
    assert matrix.HEADER in text, f"{DOC} was not written by the generator; {REGENERATE}"
    assert matrix.versions_line() in text, f"{DOC} was measured with other package versions; {REGENERATE}"
    same_cpu_kind = matrix.machine_line() in text
    committed = matrix.parse_table(text)
    expected_rows = {(s.quantizer, s.label, family) for s in matrix.SCHEMES for family in s.families}
    assert set(committed) == expected_rows, f"{DOC} covers another matrix; {REGENERATE}"
    for key in TEST_KEYS:
        fresh = dict(zip(matrix.COLUMNS, matrix.row_cells(*key), strict=True))
        row = committed[(fresh["quantizer"], fresh["scheme"], fresh["family"])]
        columns = [c for c in matrix.COLUMNS if same_cpu_kind or c not in matrix.MACHINE_DEPENDENT_COLUMNS]
        stale = {c: (row[c], fresh[c]) for c in columns if not _same(c, row[c], fresh[c])}
        assert not stale, f"{DOC} row {key} is stale (committed, fresh): {stale}; {REGENERATE}"


# --- MXFP4 checkpoints (gpt-oss's published layout) are refused with a -quant bundle, with a way that works ----


def _mxfp4_gpt_oss_checkpoint(directory):
    """A tiny gpt_oss checkpoint laid out as openai/gpt-oss-20b's: each experts tensor as uint8 MXFP4 blocks
    [E, out, in / 32, 16] and scales [E, out, in / 32] (random codes, scales near 2**0), and the config's
    quantization_config naming mxfp4."""
    from safetensors.torch import load_file, save_file

    tiny_model("gpt_oss").save_pretrained(directory)
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for key, tensor in load_file(directory / "model.safetensors").items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, inputs, outputs = tensor.shape  # gpt_oss stores [E, in, out]
            tensors[f"{key}_blocks"] = torch.randint(
                0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8, generator=generator
            )
            tensors[f"{key}_scales"] = torch.randint(
                120, 127, (experts, outputs, inputs // 32), dtype=torch.uint8, generator=generator
            )
        else:
            tensors[key] = tensor
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "lm_head"],
    }
    (directory / "config.json").write_text(json.dumps(config))


def test_an_mxfp4_checkpoint_is_refused_and_loads_once_dequantized_as_the_error_says(tmp_path):
    from transformers import Mxfp4Config

    _mxfp4_gpt_oss_checkpoint(tmp_path / "mxfp4")
    with (
        layerswap.use_bundle("gpt_oss-quant"),
        pytest.raises(
            IncompatibleQuantizerError, match=r"(?s)MXFP4 checkpoint.*Mxfp4Config\(dequantize=True\)"
        ),
    ):
        AutoModelForCausalLM.from_pretrained(
            tmp_path / "mxfp4", quantization_config=Mxfp4Config(dequantize=True)
        )
    # What the error says to do: dequantize without the bundle, save, load the result with it.
    stock = AutoModelForCausalLM.from_pretrained(
        tmp_path / "mxfp4", quantization_config=Mxfp4Config(dequantize=True)
    )
    stock.save_pretrained(tmp_path / "dequantized")
    with layerswap.use_bundle("gpt_oss-quant"):
        model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert layerswap.report(model).expert_linear_share == 1.0
    input_ids = tiny_input_ids()
    with torch.no_grad():
        assert_computed_close(model(input_ids).logits, stock(input_ids).logits)
