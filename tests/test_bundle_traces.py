"""Issue 17: a bundle acts only on the models it swapped, and leaves no trace on anything else."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2MoeForCausalLM

import layerswap
from _support.checkpoints import read_checkpoint
from _support.numerics import assert_computed_close
from _support.tiny_models import tiny_config, tiny_input_ids, tiny_model
from layerswap.swaps.quant.modules import LinearExperts


def _stock_keys(model_type, tmp_path):
    tiny_model(model_type).save_pretrained(tmp_path / "stock")
    return read_checkpoint(tmp_path / "stock")


@pytest.mark.parametrize("model_type", ["qwen2_moe", "mixtral"])
def test_a_model_built_before_enabling_saves_the_stock_layout(model_type, tmp_path):
    expected = _stock_keys(model_type, tmp_path)
    model = tiny_model(model_type)
    with layerswap.use_bundle(f"{model_type}-quant"):
        model.save_pretrained(tmp_path / "saved")
    saved = read_checkpoint(tmp_path / "saved")
    assert set(saved) == set(expected)
    assert all(torch.equal(saved[k], expected[k]) for k in expected)


def test_a_model_built_by_its_constructor_while_enabled_saves_the_stock_layout(tmp_path):
    expected = _stock_keys("qwen2_moe", tmp_path)
    layerswap.enable_bundle("qwen2_moe-quant")
    try:
        swapped = tiny_model("qwen2_moe")  # the bundle's conversions are in force for this one
        torch.manual_seed(0)
        with pytest.warns(layerswap.LayerswapWarning, match="built by its constructor"):
            model = Qwen2MoeForCausalLM(tiny_config("qwen2_moe")).eval()
        assert not any(isinstance(m, LinearExperts) for m in model.modules())
        model.save_pretrained(tmp_path / "saved")
        swapped.save_pretrained(tmp_path / "swapped")
    finally:
        layerswap.disable_bundle("qwen2_moe-quant")
    saved = read_checkpoint(tmp_path / "saved")
    assert set(saved) == set(expected)
    assert set(read_checkpoint(tmp_path / "swapped")) == set(expected)
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.parametrize("bundle", ["olmoe-fused_qkv", "olmoe-fast", "qwen2_moe-replay"])
def test_stock_models_record_attentions_and_router_logits_after_a_swapped_load(bundle, tmp_path):
    model_type = bundle.split("-")[0]
    eager = {"attn_implementation": "eager"}  # sdpa returns no attention weights
    config = tiny_config(model_type, **eager)
    built_before = AutoModelForCausalLM.from_config(config)
    layerswap.enable_bundle(bundle)
    try:
        swapped = AutoModelForCausalLM.from_config(config)
        assert layerswap.report(swapped).swapped
        with pytest.warns(layerswap.LayerswapWarning, match="built by its constructor"):
            built_by_hand = type(swapped)(config)  # outside apply_bundles: stock
        swapped_run_later = AutoModelForCausalLM.from_config(config)
        models = {"swapped": swapped, "built before": built_before, "built by hand": built_by_hand}
        _assert_records_every_layer(models, config)
    finally:
        layerswap.disable_bundle(bundle)
    _assert_records_every_layer({"swapped, run after disabling": swapped_run_later}, config)


def _assert_records_every_layer(models, config):
    for name, model in models.items():
        out = model(tiny_input_ids(), output_attentions=True, output_router_logits=True)
        assert len(out.attentions) == config.num_hidden_layers, name
        assert len(out.router_logits) == config.num_hidden_layers, name


def test_quant_experts_refuse_an_experts_implementation_they_cannot_run():
    with layerswap.use_bundle("qwen2_moe-quant"):
        model = tiny_model("qwen2_moe")
        before = model.get_experts_implementation()
        for implementation in ("grouped_mm", "batched_mm", {"": "grouped_mm"}):
            with pytest.raises(
                layerswap.ExpertsImplementationError, match=r"qwen2_moe-quant.*grouped_mm|batched_mm"
            ):
                model.set_experts_implementation(implementation)
            assert model.get_experts_implementation() == before
        model.set_experts_implementation("eager")  # what LinearExperts computes: one expert at a time
        model(tiny_input_ids())
    # Without the bundle's hook, a changed config is caught when the experts run.
    model.set_experts_implementation("batched_mm")
    with pytest.raises(layerswap.ExpertsImplementationError, match="qwen2_moe-quant"):
        model(tiny_input_ids())


def test_fast_experts_run_the_experts_implementation_that_is_set(monkeypatch, tmp_path):
    from layerswap.swaps.fast import modules as fused_experts

    calls = []
    fused = fused_experts.fused_moe
    monkeypatch.setattr(fused_experts, "fused_moe", lambda *a, **k: calls.append(1) or fused(*a, **k))
    stock = tiny_model("olmoe")
    stock.save_pretrained(tmp_path)
    with torch.no_grad():
        expected = {name: None for name in ("eager", "grouped_mm")}
        for name in expected:
            stock.set_experts_implementation(name)
            expected[name] = stock(tiny_input_ids()).logits
        with layerswap.use_bundle("olmoe-fast"):
            model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
            model(tiny_input_ids())
            assert calls, "the fused kernel runs by default"
            for name in ("grouped_mm", "eager"):
                calls.clear()
                model.set_experts_implementation(name)
                assert_computed_close(model(tiny_input_ids()).logits, expected[name])
                assert not calls, f"{name} was set, but the fused kernel ran"
        layerswap.register_experts_backend()
        try:
            model.set_experts_implementation("layerswap")
            model(tiny_input_ids())
            assert calls
        finally:
            layerswap.unregister_experts_backend()


def _checkpoint_with_one_expert_cut(tmp_path, fused):
    """A qwen2_moe checkpoint whose layer-0 down_proj of expert 3 (or fused down_proj) lost two columns."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    tiny_model("qwen2_moe").save_pretrained(tmp_path, save_original_format=not fused)
    shard = next(Path(tmp_path).glob("*.safetensors"))
    tensors = load_file(shard)
    key = "model.layers.0.mlp.experts." + ("down_proj" if fused else "3.down_proj.weight")
    expected = tuple(tensors[key].shape)
    tensors[key] = tensors[key][..., :-2].clone()
    save_file(tensors, shard, metadata={"format": "pt"})
    return key, tuple(tensors[key].shape), expected


@pytest.mark.parametrize(
    ("bundle", "fused"),
    [("qwen2_moe-fast", False), ("qwen2_moe-fast", True), ("qwen2_moe-quant", False)],
    ids=["fast-per_expert", "fast-fused", "quant-per_expert"],
)
def test_a_wrong_shaped_expert_weight_is_named_with_both_shapes(bundle, fused, tmp_path):
    key, found, expected = _checkpoint_with_one_expert_cut(tmp_path, fused)
    with layerswap.use_bundle(bundle), pytest.raises(layerswap.CheckpointShapeError) as error:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    message = str(error.value)
    assert key in message and str(found) in message and str(expected) in message, message
    assert "lacks" not in message and "missing" not in message
    assert isinstance(error.value, RuntimeError)  # what stock transformers raises for the same load


def _class_bindings():
    import sys

    return {
        (name, attribute): value
        for name, module in list(sys.modules.items())
        if name.startswith("transformers") and module is not None
        for attribute, value in list(vars(module).items())
        if isinstance(value, type)
    }


def test_use_bundle_swaps_models_built_by_their_constructor(tmp_path):
    config = tiny_config(
        "granitemoe"
    )  # stock saves granitemoe's experts fused: the layout must be remembered
    model_class = type(tiny_model("granitemoe"))
    stock_keys = set(_stock_keys("granitemoe", tmp_path))
    before = _class_bindings()
    with layerswap.use_bundle("granitemoe-quant"):
        model = model_class(config)
    assert _class_bindings() == before
    assert any(isinstance(m, LinearExperts) for m in model.modules())
    model.save_pretrained(tmp_path / "saved")  # after the bundle is disabled
    assert set(read_checkpoint(tmp_path / "saved")) == stock_keys
    assert not any(isinstance(m, LinearExperts) for m in model_class(config).modules())


def test_apply_bundles_swaps_manual_construction_and_an_unswapped_build_warns():
    config = tiny_config("qwen2_moe")
    layerswap.enable_bundle("qwen2_moe-quant")
    try:
        with layerswap.apply_bundles() as names:
            assert names == ("qwen2_moe-quant",)
            model = Qwen2MoeForCausalLM(config)
        assert any(isinstance(m, LinearExperts) for m in model.modules())
        with pytest.warns(layerswap.LayerswapWarning, match=r"qwen2_moe-quant.*apply_bundles") as caught:
            stock = Qwen2MoeForCausalLM(config)
        assert len(caught) == 1  # one warning per model, not one per nested PreTrainedModel
        assert not any(isinstance(m, LinearExperts) for m in stock.modules())
    finally:
        layerswap.disable_bundle("qwen2_moe-quant")


def _unmatched_plan_entries(model):
    from transformers.distributed.parallel_utils import _get_parameter_plan

    params = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    modules = {n for n, _ in model.named_modules()}
    return sorted(
        pattern
        for pattern in model.tp_plan
        if all(_get_parameter_plan(p, {pattern: ""}, is_weight=True) is None for p in params)
        and all(_get_parameter_plan(m, {pattern: ""}, is_weight=False) is None for m in modules)
    )


@pytest.mark.parametrize("bundle", ["qwen2_moe-quant", "mixtral-quant", "olmoe-fast", "olmoe-fused_qkv"])
@pytest.mark.parametrize("build", ["from_config", "constructor"])
def test_the_tensor_parallel_plan_names_the_swapped_modules(bundle, build):
    model_type, purpose = bundle.split("-")
    config = tiny_config(model_type)
    stock = tiny_model(model_type)
    with layerswap.use_bundle(bundle):
        model = AutoModelForCausalLM.from_config(config) if build == "from_config" else type(stock)(config)
    assert layerswap.report(model).swapped
    # The tiny qwen2_moe has no dense layers for the plan's dense mlp entries, in stock too.
    assert set(_unmatched_plan_entries(model)) <= set(_unmatched_plan_entries(stock)), model.tp_plan
    kept = {k: v for k, v in stock.tp_plan.items() if ".experts" not in k and "_proj" not in k.split(".")[-1]}
    assert kept.items() <= model.tp_plan.items()
    if purpose == "quant":
        names = type(model.model.layers[0].mlp.experts).expert_names
        experts = next(k for k in stock.tp_plan if k.endswith("experts.down_proj")).rsplit(".", 1)[0]
        assert model.tp_plan[f"{experts}.*.{names.gate}"] == "colwise"
        assert model.tp_plan[f"{experts}.*.{names.up}"] == "colwise"
        assert model.tp_plan[f"{experts}.*.{names.down}"] == "rowwise"
        assert experts not in model.tp_plan  # moe_tp_experts sums outputs the rowwise down_proj already sums


def test_from_pretrained_with_no_weights_at_all_initialises_and_a_partial_state_dict_is_refused():
    # from_pretrained(None, config=..., state_dict={}) is transformers' way to build and initialise every weight
    # (its test_can_init_all_missing_weights); a partial state dict is still a checkpoint lacking expert weights.
    config = tiny_config("qwen2_moe")
    with layerswap.use_bundle("qwen2_moe-quant"):
        model = Qwen2MoeForCausalLM.from_pretrained(None, config=config, state_dict={})
        assert any(isinstance(m, LinearExperts) for m in model.modules())
        partial = {"model.embed_tokens.weight": model.model.embed_tokens.weight.detach().clone()}
        with pytest.raises(layerswap.MissingExpertWeightsError):
            Qwen2MoeForCausalLM.from_pretrained(None, config=config, state_dict=partial)


def test_an_adapter_trained_on_quant_experts_is_refused_for_a_model_without_the_bundle(tmp_path):
    import peft

    tiny_model("qwen2_moe").save_pretrained(tmp_path / "base")
    with layerswap.use_bundle("qwen2_moe-quant"):
        swapped = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        config = peft.LoraConfig(target_modules=["gate_proj", "up_proj", "down_proj"], r=4)
        peft.get_peft_model(swapped, config).save_pretrained(tmp_path / "adapter")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    with pytest.raises(
        layerswap.AdapterLayoutError, match=r"per-expert nn.Linear.*experts\.\d+\.\w+_proj.*qwen2_moe-quant"
    ):
        layerswap.check_adapter(stock, tmp_path / "adapter")
    with layerswap.use_bundle("qwen2_moe-quant"):
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    layerswap.check_adapter(base, tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    layerswap.check_adapter(loaded, tmp_path / "adapter")


@pytest.mark.parametrize(
    "model_type, targets",
    [("qwen3_moe", ["gate_proj", "up_proj", "down_proj"]), ("mixtral", ["w1", "w2", "w3"])],
)
def test_lora_targets_quant_experts_by_their_per_expert_names(model_type, targets):
    # PEFT rewrites these v4 names into the v5 fused parameters (target_parameters gate_up_proj, down_proj) for
    # model types whose experts v5 fused; a '-quant' model has the per-expert modules instead, and PEFT found
    # nothing to target ("No `target_modules` passed but also no `target_parameters` found").
    import peft

    with layerswap.use_bundle(f"{model_type}-quant"):
        model = tiny_model(model_type)
    adapted = peft.get_peft_model(model, peft.LoraConfig(target_modules=targets, r=4))
    adapted_experts = {n.rsplit(".lora_A", 1)[0] for n, _ in adapted.named_parameters() if ".lora_A." in n}
    # 2 layers, 8 experts, 3 projections, and nothing else.
    assert len(adapted_experts) == 2 * 8 * 3 and all(".experts." in n for n in adapted_experts)


def test_peft_itself_refuses_an_adapter_whose_modules_the_model_lacks(tmp_path):
    # Without any call to check_adapter: PeftModel.from_pretrained loaded 0 of the adapter's 96 expert tensors,
    # warning only, and left them at their random init.
    import peft

    tiny_model("qwen2_moe").save_pretrained(tmp_path / "base")
    with layerswap.use_bundle("qwen2_moe-quant"):
        swapped = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        config = peft.LoraConfig(
            target_modules=["gate_proj", "up_proj", "down_proj"], r=4, init_lora_weights=False
        )
        trained = peft.get_peft_model(swapped, config)
        trained.save_pretrained(tmp_path / "adapter")
        expected = trained(tiny_input_ids()).logits
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    with pytest.raises(layerswap.AdapterLayoutError, match="qwen2_moe-quant"):
        peft.PeftModel.from_pretrained(stock, tmp_path / "adapter")
    with layerswap.use_bundle("qwen2_moe-quant"):
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    torch.testing.assert_close(loaded(tiny_input_ids()).logits, expected)


def test_the_peft_check_is_installed_when_peft_is_imported_after_layerswap_and_undone():
    import subprocess
    import sys

    script = (
        "import layerswap, peft.peft_model as pm\n"
        "import peft.utils.transformers_weight_conversion as conversion\n"
        "assert getattr(pm.PeftModel.load_adapter, '_layerswap_checked', False)\n"
        "convert = conversion.convert_peft_config_for_transformers\n"
        "assert getattr(convert, '_layerswap_checked', False)\n"
        "from layerswap import peft_adapters\n"
        "peft_adapters.unwatch_peft()\n"
        "assert not getattr(pm.PeftModel.load_adapter, '_layerswap_checked', False)\n"
        "assert not getattr(conversion.convert_peft_config_for_transformers, '_layerswap_checked', False)\n"
        "print('ok')\n"
    )
    assert "peft" not in script.split("\n")[0].split(",")[0]  # layerswap first, then peft
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
