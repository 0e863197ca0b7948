"""The -quant conversions, both ways, for every family: stock checkpoint -> layerswap -> save -> stock."""

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

import layerswap
from _support.checkpoints import assert_state_dicts_identical, drop_keys, read_checkpoint
from _support.families import MOE_FAMILIES
from _support.tiny_models import auto_class, text_logits, tiny_input_ids, tiny_model
from _support.transformers_support import needs_bundle, needs_model_type
from layerswap.errors import MissingExpertWeightsError
from layerswap.swaps.quant.modules import LinearExperts


def _router_outputs(model, family, input_ids):
    """Each router's first output (the logits), in module order, recorded by forward hooks."""
    outputs = []
    handles = [
        m.register_forward_hook(lambda _m, _i, out: outputs.append(out[0] if isinstance(out, tuple) else out))
        for m in model.modules()
        if type(m).__name__ == family.router
    ]
    with torch.no_grad():
        logits = text_logits(model, input_ids)
    for handle in handles:
        handle.remove()
    return logits, outputs


@pytest.fixture(scope="module", params=MOE_FAMILIES, ids=lambda f: f.model_type)
def stock_checkpoint(request, tmp_path_factory):
    family = request.param
    model = tiny_model(family.model_type)
    per_expert = tmp_path_factory.mktemp(f"{family.model_type}-stock")
    fused = tmp_path_factory.mktemp(f"{family.model_type}-fused")
    model.save_pretrained(per_expert)
    model.save_pretrained(fused, save_original_format=False)
    return family, model, per_expert, fused


@pytest.mark.parametrize("layout", ["stock", "fused"])
def test_loads_both_layouts_with_same_outputs_and_saves_back_stock(stock_checkpoint, layout, tmp_path):
    family, stock, per_expert, fused = stock_checkpoint
    source = per_expert if layout == "stock" else fused
    input_ids = tiny_input_ids()
    expected_logits, expected_routers = _router_outputs(stock, family, input_ids)

    with layerswap.use_bundle(f"{family.model_type}-quant"):
        model, info = auto_class(family.model_type).from_pretrained(source, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert any(isinstance(m, LinearExperts) for m in model.modules())
        logits, routers = _router_outputs(model.eval(), family, input_ids)
        model.save_pretrained(tmp_path)

    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)
    # Rows without a router name (granitemoe_swa, hy_v3, kolibri1) are compared on logits alone.
    assert len(routers) == len(expected_routers) and (len(routers) > 0 or family.router is None)
    for got, want in zip(routers, expected_routers, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    saved = read_checkpoint(tmp_path)
    if layout == "stock":
        # Same keys, same shapes, same bytes as the stock checkpoint it came from.
        original = read_checkpoint(per_expert)
        assert set(saved) == set(original)
        assert all(torch.equal(saved[k], original[k]) for k in original)
    reloaded, info = auto_class(family.model_type).from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert_state_dicts_identical(stock, reloaded)


def test_checkpoint_without_expert_weights_is_an_error_naming_the_keys(stock_checkpoint, tmp_path):
    family, stock, _, _ = stock_checkpoint
    stock.save_pretrained(tmp_path)
    # Per-expert checkpoints lose expert 1; fused stock checkpoints (granitemoe's input_linear, granitemoe_swa's
    # gate_up_proj) lose the fused gate/up tensor.
    dropped = drop_keys(
        tmp_path,
        lambda key: (
            ".experts.1." in key
            or "input_linear" in key
            or key.endswith(
                (
                    "experts.gate_up_proj",
                    "experts.up_proj",
                    "experts.fc1.weight",
                    "experts.mlp.w1",
                    "experts.w13_weight",
                    ".moe.up_proj.weight",  # step3p7: gate and up stacked separately
                )
            )
        ),
    )
    assert dropped
    with (
        layerswap.use_bundle(f"{family.model_type}-quant"),
        pytest.raises(MissingExpertWeightsError) as error,
    ):
        auto_class(family.model_type).from_pretrained(tmp_path)
    assert "randomly initialised" in str(error.value)
    named = str(error.value).split("Loading would")[0]
    # Per-expert names: `...experts.3.gate_proj.weight`, or jetmoe's `...mlp.input_linear.3.weight`.
    assert re.search(r"\.\d+\.(\w+\.)?(experts\.\d+\.\w+|input_linear\.\d+)\.weight", named), named


def test_fused_checkpoint_missing_experts_is_an_error(tmp_path):
    model = tiny_model("qwen2_moe")
    model.save_pretrained(tmp_path, save_original_format=False)
    drop_keys(tmp_path, lambda key: key.endswith("layers.1.mlp.experts.down_proj"))
    with layerswap.use_bundle("qwen2_moe-quant"), pytest.raises(MissingExpertWeightsError, match="down_proj"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("model_type", ["mixtral", "granitemoe"])
def test_from_config_model_saves_stock_layout(model_type, tmp_path):
    # A model built with from_config has no record of a loaded layout: it saves the family's stock one.
    with layerswap.use_bundle(f"{model_type}-quant"):
        model = tiny_model(model_type)
        model.save_pretrained(tmp_path / "ours")
        expected = text_logits(model, tiny_input_ids())
    stock, info = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    torch.testing.assert_close(text_logits(stock, tiny_input_ids()), expected, atol=1e-5, rtol=1e-5)
    stock.save_pretrained(tmp_path / "stock")
    ours, theirs = read_checkpoint(tmp_path / "ours"), read_checkpoint(tmp_path / "stock")
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize(
    "bundle", [pytest.param("llama-fused_qkv", marks=needs_bundle("llama-fused_qkv")), "mixtral-quant"]
)
def test_a_model_built_under_a_bundle_saves_stock_layout_after_the_bundle_is_disabled(bundle, tmp_path):
    model_type = bundle.split("-")[0]
    with layerswap.use_bundle(bundle):
        model = tiny_model(model_type)
    expected = text_logits(model, tiny_input_ids())
    model.save_pretrained(tmp_path)  # no bundle enabled any more
    stock, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    torch.testing.assert_close(text_logits(stock, tiny_input_ids()), expected, atol=1e-5, rtol=1e-5)


def test_fused_checkpoint_splits_without_copies_into_weights_that_savers_see_as_separate(tmp_path):
    # A fused `[E, 2I, H]` checkpoint splits into per-expert weights over the fused tensor's own bytes (expert 0's
    # up rows right after its gate rows), so loading it with the bundle holds the experts once. Each weight has a
    # storage of its own: savers that refuse or deduplicate shared storages keep every expert.
    from accelerate.utils import clean_state_dict_for_safetensors
    from safetensors.torch import load_file, save_file

    tiny_model("qwen2_moe").save_pretrained(tmp_path, save_original_format=False)
    with layerswap.use_bundle("qwen2_moe-quant"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path)
    expert = model.model.layers[0].mlp.experts[0]
    gate, up = expert.gate_proj.weight, expert.up_proj.weight
    assert up.data_ptr() - gate.data_ptr() == gate.nbytes
    storages = [p.untyped_storage() for p in model.parameters()]
    assert len({s.data_ptr() for s in storages}) == len(storages)
    assert sum(s.nbytes() for s in storages) == sum(p.nbytes for p in model.parameters())

    state = model.state_dict()
    assert clean_state_dict_for_safetensors(dict(state)).keys() == state.keys()
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "raw.safetensors")
    reloaded = load_file(tmp_path / "raw.safetensors")
    assert all(torch.equal(reloaded[k], v) for k, v in state.items())


@needs_model_type("diffusion_gemma")
@pytest.mark.parametrize("layout", ["stock", "fused"])
def test_experts_tied_across_sub_models_load_once_and_save_back_stock(layout, tmp_path):
    # diffusion_gemma's published checkpoints tie the encoder's layers to the decoder's, experts included
    # (tie_word_embeddings, True by default): the checkpoint holds each expert once, and the swapped model must tie
    # its per-expert Linears the same way (the stock tie patterns name gate_up_proj / down_proj).
    stock = tiny_model("diffusion_gemma", tie_word_embeddings=True)
    stock.save_pretrained(tmp_path / "stock", save_original_format=layout == "stock")
    input_ids = tiny_input_ids()
    with layerswap.use_bundle("diffusion_gemma-quant"):
        model, info = auto_class("diffusion_gemma").from_pretrained(
            tmp_path / "stock", output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        encoder = model.model.encoder.language_model.layers[0].experts
        assert isinstance(encoder, LinearExperts)
        # As the stock model holds them (tied; transformers 5.15 left a from_config model's experts untied after
        # loads in other threads, in stock and bundle models alike): never random.
        stock_gate = stock.model.encoder.language_model.layers[0].experts.gate_up_proj[3].chunk(2)[0]
        assert torch.equal(encoder[3].gate_proj.weight, stock_gate)
        with torch.no_grad():
            torch.testing.assert_close(
                text_logits(model, input_ids), text_logits(stock, input_ids), atol=1e-5, rtol=1e-5
            )
        model.save_pretrained(tmp_path / "ours")
    reloaded, info = auto_class("diffusion_gemma").from_pretrained(
        tmp_path / "ours", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert_state_dicts_identical(stock, reloaded)


@needs_model_type("diffusion_gemma")
def test_tied_experts_missing_from_the_checkpoint_are_an_error(tmp_path):
    # Tying fills the encoder's experts from the decoder's; with the decoder's gone, nothing fills either.
    tiny_model("diffusion_gemma", tie_word_embeddings=True).save_pretrained(tmp_path)
    assert drop_keys(tmp_path, lambda key: "decoder.layers.1.experts" in key)
    with (
        layerswap.use_bundle("diffusion_gemma-quant"),
        pytest.raises(MissingExpertWeightsError, match=r"lacks \d+ weight.*decoder\.layers\.1\.experts"),
    ):
        auto_class("diffusion_gemma").from_pretrained(tmp_path)


def test_under_expert_parallelism_a_fused_tensor_loads_only_the_experts_this_rank_holds():
    # Rank 1 of 2 holds experts 4..7: the fused tensor's converter names expert 4's weight (transformers accepts only
    # a key the model has), and the split makes those experts alone, each a copy, so the fused tensor is freed.
    from layerswap.swaps.quant.conversion import SplitFusedExperts, _first_held_expert

    with layerswap.use_bundle("qwen3_moe-quant"):
        model = AutoModelForCausalLM.from_config(tiny_model("qwen3_moe").config)
    experts = model.model.layers[0].mlp.experts
    experts._layerswap_shard_experts(1, 2)
    key = "model.layers.0.mlp.experts.0.gate_proj.weight"
    assert _first_held_expert(model, key) == "model.layers.0.mlp.experts.4.gate_proj.weight"
    assert _first_held_expert(model, key.removeprefix("model.")) == "layers.0.mlp.experts.4.gate_proj.weight"
    assert _first_held_expert(model, key.replace("layers.0", "layers.1")) == key.replace(
        "layers.0", "layers.1"
    )

    fused = torch.randn(8, 2 * 64, 64)
    split = SplitFusedExperts(("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"))
    pieces = split.convert(
        {"mlp.experts.gate_up_proj": fused},
        [],
        [],
        model=model,
        full_layer_name="model.layers.0.mlp.experts.4.gate_proj.weight",
    )
    assert sorted(pieces) == sorted(
        f"mlp.experts.{e}.{p}.weight" for e in range(4, 8) for p in ("gate_proj", "up_proj")
    )
    assert torch.equal(pieces["mlp.experts.5.up_proj.weight"], fused[5, 64:])
    assert all(p.untyped_storage().data_ptr() != fused.untyped_storage().data_ptr() for p in pieces.values())
