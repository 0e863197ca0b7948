"""The bundle registry: enable/disable restore transformers' state exactly, compose, and refuse bad input."""

import contextlib
import sys
import threading
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, monkey_patching

import layerswap
from _support.checkpoints import assert_state_dicts_identical
from _support.global_state import comparable, global_state
from _support.numerics import assert_computed_close
from _support.tiny_models import tiny_input_ids, tiny_model
from layerswap import catalog
from layerswap import registry as _registry
from layerswap._hf import compat as _compat
from layerswap.bundle import Bundle, Patch
from layerswap.errors import BundleConflictError, UnknownBundleError, UnsupportedTransformersError
from layerswap.swaps.quant.modules import LinearExperts, linear_experts_adapter


@pytest.fixture(scope="module")
def qwen_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2_moe")
    tiny_model("qwen2_moe").save_pretrained(directory)
    return directory


def test_enable_then_disable_restores_every_piece_of_state(qwen_checkpoint):
    before = global_state()
    layerswap.enable_bundle("qwen2_moe-quant")
    layerswap.enable_bundle("mixtral-quant")
    during = global_state()
    assert during["patch_mapping"] != before["patch_mapping"]
    AutoModelForCausalLM.from_pretrained(qwen_checkpoint)  # lets transformers rewrite output recorders
    layerswap.disable_bundle("mixtral-quant")
    layerswap.disable_bundle("qwen2_moe-quant")
    assert comparable(before, global_state()) == before


def test_after_disable_a_fresh_stock_load_is_bit_identical_and_records_attentions(qwen_checkpoint):
    eager = {"attn_implementation": "eager"}  # sdpa returns no attention weights
    stock_before = AutoModelForCausalLM.from_pretrained(qwen_checkpoint, **eager)
    with layerswap.use_bundle("qwen2_moe-quant"):
        swapped = AutoModelForCausalLM.from_pretrained(qwen_checkpoint, **eager)
        assert len(swapped(tiny_input_ids(), output_attentions=True).attentions) == 2
    stock_after = AutoModelForCausalLM.from_pretrained(qwen_checkpoint, **eager)
    assert not any(isinstance(m, LinearExperts) for m in stock_after.modules())
    assert_state_dicts_identical(stock_before, stock_after)
    out = stock_after(tiny_input_ids(), output_attentions=True)
    assert out.attentions is not None and len(out.attentions) == 2
    assert_computed_close(out.logits, stock_before(tiny_input_ids()).logits)


def test_enabling_twice_is_idempotent_and_other_options_are_refused():
    layerswap.enable_bundle("qwen2_moe-quant")
    layerswap.enable_bundle("qwen2_moe-quant")
    assert layerswap.enabled_bundles() == ("qwen2_moe-quant",)
    with pytest.raises(layerswap.BundleError, match="already enabled"):
        layerswap.enable_bundle("qwen2_moe-quant", keep_unquantized=())
    layerswap.disable_bundle("qwen2_moe-quant")
    assert layerswap.enabled_bundles() == ()


def test_unknown_bundle_lists_the_closest_names():
    with pytest.raises(UnknownBundleError, match=r"'qwen2_moe-quant'"):
        layerswap.enable_bundle("qwen2moe-quant")
    with pytest.raises(UnknownBundleError, match="layerswap list"):
        layerswap.get_bundle("nothing-like-it")


def test_bad_options_and_disabling_a_disabled_bundle_are_clear_errors():
    with pytest.raises(layerswap.BundleError, match="accepts \\['keep_unquantized'\\]"):
        layerswap.enable_bundle("qwen2_moe-quant", keep_quantized=())
    with pytest.raises(layerswap.BundleError, match="tuple of module-name suffixes"):
        layerswap.enable_bundle("qwen2_moe-quant", keep_unquantized="mlp.gate")
    with pytest.raises(layerswap.BundleError, match="not enabled"):
        layerswap.disable_bundle("qwen2_moe-quant")
    assert layerswap.enabled_bundles() == ()


def test_use_bundle_restores_even_when_the_block_raises():
    before = global_state()
    with pytest.raises(RuntimeError, match="boom"), layerswap.use_bundle("qwen2_moe-quant", "olmoe-quant"):
        assert set(layerswap.enabled_bundles()) == {"qwen2_moe-quant", "olmoe-quant"}
        raise RuntimeError("boom")
    assert layerswap.enabled_bundles() == ()
    assert comparable(before, global_state()) == before


def test_use_bundle_keeps_bundles_enabled_before_it():
    layerswap.enable_bundle("qwen2_moe-quant")
    with layerswap.use_bundle("qwen2_moe-quant", "mixtral-quant"):
        pass
    assert layerswap.enabled_bundles() == ("qwen2_moe-quant",)
    layerswap.disable_bundle("qwen2_moe-quant")


def _register(monkeypatch, bundle):
    monkeypatch.setitem(catalog.CATALOG, bundle.name, bundle)


def test_two_bundles_replacing_one_class_differently_name_both(monkeypatch):
    rival = Bundle(
        name="qwen2_moe-rival",
        purpose="test",
        model_types=("qwen2_moe",),
        description="replaces the same class with another adapter",
        patches=(
            Patch(
                "transformers.models.qwen2_moe.modeling_qwen2_moe",
                "Qwen2MoeExperts",
                linear_experts_adapter("qwen2_moe-quant", ("qwen2_moe",)),
            ),
        ),
    )
    _register(monkeypatch, rival)
    layerswap.enable_bundle("qwen2_moe-quant")
    with pytest.raises(BundleConflictError) as error:
        layerswap.enable_bundle("qwen2_moe-rival")
    message = str(error.value)
    assert "qwen2_moe-rival" in message and "qwen2_moe-quant" in message and "Qwen2MoeExperts" in message
    assert layerswap.enabled_bundles() == ("qwen2_moe-quant",)
    layerswap.disable_bundle("qwen2_moe-quant")


def test_a_patch_registered_outside_layerswap_is_a_conflict():
    class Foreign(torch.nn.Module):
        pass

    monkey_patching.register_patch_mapping({"Qwen2MoeExperts": Foreign})
    try:
        with pytest.raises(BundleConflictError, match="outside layerswap"):
            layerswap.enable_bundle("qwen2_moe-quant")
        assert layerswap.enabled_bundles() == ()
    finally:
        monkey_patching.unregister_patch_mapping(["Qwen2MoeExperts"])


def test_a_class_the_installed_transformers_lacks_names_class_and_version(monkeypatch):
    import transformers

    ghost = Bundle(
        name="qwen2_moe-ghost",
        purpose="test",
        model_types=("qwen2_moe",),
        description="names a class that does not exist",
        patches=(Patch("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeGhost", lambda o, _: o),),
    )
    _register(monkeypatch, ghost)
    with pytest.raises(UnsupportedTransformersError) as error:
        layerswap.enable_bundle("qwen2_moe-ghost")
    assert "Qwen2MoeGhost" in str(error.value) and transformers.__version__ in str(error.value)


def test_a_replacement_with_another_forward_contract_is_refused(monkeypatch):
    class WrongForward(torch.nn.Module):
        def forward(self, x, routing):
            return x

    wrong = Bundle(
        name="qwen2_moe-wrong",
        purpose="test",
        model_types=("qwen2_moe",),
        description="a replacement whose forward differs",
        patches=(
            Patch(
                "transformers.models.qwen2_moe.modeling_qwen2_moe",
                "Qwen2MoeExperts",
                lambda o, _: WrongForward,
            ),
        ),
    )
    _register(monkeypatch, wrong)
    with pytest.raises(layerswap.BundleError, match="does not match the forward"):
        layerswap.enable_bundle("qwen2_moe-wrong")
    assert layerswap.enabled_bundles() == ()


def test_wrong_family_load_warns_that_the_bundle_swapped_nothing(tmp_path):
    tiny_model("olmoe").save_pretrained(tmp_path)
    with (
        layerswap.use_bundle("qwen2_moe-quant"),
        pytest.warns(layerswap.LayerswapWarning, match="swapped nothing"),
    ):
        model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not any(isinstance(m, LinearExperts) for m in model.modules())


def test_eight_threads_enabling_disabling_and_loading_concurrently(qwen_checkpoint):
    before = global_state()
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)
    names = ["qwen2_moe-quant", "mixtral-quant", "olmoe-quant", "qwen3_moe-quant"]

    def worker(index: int) -> None:
        try:
            barrier.wait()
            for _ in range(3):
                if index % 2:
                    with layerswap.use_bundle(names[index % 4]):
                        pass
                else:
                    with layerswap.use_bundle("qwen2_moe-quant"):
                        model = AutoModelForCausalLM.from_pretrained(qwen_checkpoint)
                        # Another thread may disable its own use of the bundle meanwhile; ours stays in force
                        # until our block ends, so the model is swapped.
                        assert any(isinstance(m, LinearExperts) for m in model.modules())
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert layerswap.enabled_bundles() == ()
    assert comparable(before, global_state()) == before


def test_list_and_get_bundles():
    bundles = layerswap.list_bundles()
    assert {b.name for b in bundles} >= {"qwen2_moe-quant", "mixtral-quant", "deepseek_v3-quant"}
    bundle = layerswap.get_bundle("qwen2_moe-quant")
    assert bundle.model_types == ("qwen2_moe",) and bundle.purpose == "quant" and bundle.description
    assert _registry.enabled_bundles() == ()


def test_an_error_while_building_a_model_leaves_no_class_swapped():
    # transformers' apply_patches does not restore classes when the model constructor raises; layerswap does.
    import transformers.models.qwen2_moe.modeling_qwen2_moe as modeling

    from _support.tiny_models import tiny_config

    stock_class = modeling.Qwen2MoeExperts
    config = tiny_config("qwen2_moe", moe_intermediate_size=-1)  # makes the experts' constructor raise
    with layerswap.use_bundle("qwen2_moe-quant"), pytest.raises(RuntimeError):
        AutoModelForCausalLM.from_config(config)
    assert modeling.Qwen2MoeExperts is stock_class


def _transformers_class_bindings():
    import sys

    return {
        (module.__name__, name): value
        for module in list(sys.modules.values())
        if getattr(module, "__name__", "").startswith("transformers") and not isinstance(module, type)
        for name, value in list(vars(module).items())
        if isinstance(value, type)
    }


@contextlib.contextmanager
def _enabled(*names):
    # enable_bundle, not use_bundle: a use_bundle block swaps the classes itself, for models built by hand.
    for name in names:
        layerswap.enable_bundle(name)
    try:
        yield
    finally:
        for name in reversed(names):
            layerswap.disable_bundle(name)


def test_class_swap_is_the_one_transformers_apply_patches_makes_and_is_undone():
    # layerswap swaps classes itself while a bundle is enabled (transformers' apply_patches spends ~0.35 s per
    # model build in dir() of its lazy modules); both must bind the same classes, regex patterns included.
    import transformers.models.llama.modeling_llama
    import transformers.models.olmoe.modeling_olmoe  # noqa: F401

    from layerswap._hf import patching

    # transformers 5.15-5.20 alias old module paths with modules whose dir() imports their target (an image
    # processor needing torchvision, say), and its own apply_patches lists every module with dir().
    try:
        for module in list(sys.modules.values()):
            alias = isinstance(module, types.ModuleType) and "__dir__" in vars(module)
            if alias and module.__name__.startswith("transformers."):
                dir(module)
    except ImportError as error:
        pytest.skip(f"transformers' own apply_patches cannot run here, to compare with: {error!r}")

    class Regex(torch.nn.Module):
        pass

    # An attention swap too where the installed transformers supports '-fused_qkv' (_compat: from 5.23).
    fused_qkv = _compat.unsupported_reason("fused_qkv") is None
    bundles = ("qwen2_moe-quant", "llama-fused_qkv") if fused_qkv else ("qwen2_moe-quant",)
    before = _transformers_class_bindings()
    monkey_patching.register_patch_mapping({"^Olmoe.*Experts$": Regex})
    try:
        with _enabled(*bundles):
            with monkey_patching.apply_patches():
                stock = _transformers_class_bindings()
            with patching._swap_classes():
                ours = _transformers_class_bindings()
            assert _transformers_class_bindings() == before
    finally:
        monkey_patching.unregister_patch_mapping(["^Olmoe.*Experts$"])
    assert ours == stock
    swapped = {key for key, value in ours.items() if before.get(key) is not value}
    assert ("transformers.models.olmoe.modeling_olmoe", "OlmoeExperts") in swapped
    assert ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeExperts") in swapped
    assert (("transformers.models.llama.modeling_llama", "LlamaAttention") in swapped) is fused_qkv
