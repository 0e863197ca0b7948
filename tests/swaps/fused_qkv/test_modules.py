"""FusedQKVAttention against the stock attention of every family with a '-fused_qkv' bundle.

Tiny random configs with GQA (tiny_config: 4 heads, 2 kv heads), q/k/v biases wherever the family's config has a
switch for them, and sliding windows (window 4, shorter than the prompt) for the families that have them. Every
model is loaded from one stock checkpoint per family, with and without the bundle.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import transformers.distributed.mixin as distributed_mixin
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig, DynamicCache
from transformers.distributed import DistributedConfig
from transformers.distributed.mixin import DistributedMixin
from transformers.models.llama.modeling_llama import LlamaAttention

import layerswap
from _support.checkpoints import checkpoint_factory
from _support.global_state import assert_wrapper_shared_and_restored
from _support.tiny_models import tiny_input_ids, tiny_model
from layerswap import FusedQKVParallelismError
from layerswap.bundle import BundleOptions
from layerswap.catalog import CATALOG
from layerswap.errors import UnsupportedTransformersError
from layerswap.families import FAMILIES
from layerswap.swaps.fused_qkv.modules import FusedQKVAttention, fused_qkv_adapter

FUSED_TYPES = [f.model_type for f in FAMILIES if f"{f.model_type}-fused_qkv" in CATALOG]
# The families the issue names; the slower composite checks run on these.
CORE_TYPES = ["llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe"]
# A window shorter than the 7-token prompt, so the sliding layers really mask.
_SLIDING: dict[str, dict] = {
    "mistral": {"sliding_window": 4},
    "mixtral": {"sliding_window": 4},
    "qwen2": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    "qwen3": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
}


def fused_qkv_overrides(model_type: str) -> dict:
    defaults = AutoConfig.for_model(model_type)
    overrides = {switch: True for switch in ("attention_bias", "qkv_bias") if hasattr(defaults, switch)}
    return {**overrides, **_SLIDING.get(model_type, {})}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_factory(tmp_path_factory, fused_qkv_overrides)


def _supports_sdpa(model_type: str) -> bool:
    config = AutoConfig.for_model(model_type)
    return AutoModelForCausalLM._model_mapping[type(config)]._supports_sdpa


def load(path: Path, model_type: str | None = None, *bundles: str, **kwargs) -> nn.Module:
    """from_pretrained, with `model_type`'s fused_qkv bundle (and `bundles`) enabled if given."""
    if model_type is None:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    with layerswap.use_bundle(f"{model_type}-fused_qkv", *bundles):
        return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def fused_modules(model: nn.Module) -> list[FusedQKVAttention]:
    return [m for m in model.modules() if isinstance(m, FusedQKVAttention)]


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", FUSED_TYPES)
def test_logits_match_stock(checkpoint, model_type, implementation):
    if implementation == "sdpa" and not _supports_sdpa(model_type):
        pytest.skip(f"stock {model_type} has no sdpa attention")
    path = checkpoint(model_type)
    stock = load(path, attn_implementation=implementation)
    fused = load(path, model_type, attn_implementation=implementation)
    modules = fused_modules(fused)
    assert modules and all(isinstance(m, m._layerswap_original) for m in modules)
    assert not any(
        f".{name}." in key for key in fused.state_dict() for name in ("q_proj", "k_proj", "v_proj")
    )
    calls = []
    if implementation == "eager":
        # One fused GEMM per attention forward: the stock forward's q/k/v calls took its parts, no fallback.
        # (A hooked qkv_proj always takes the one GEMM; sdpa below runs the default CPU choice, three GEMMs on
        # the fused weight for this fp32 prompt.)
        for module in modules:
            module.qkv_proj.register_forward_hook(lambda *_: calls.append(1))
    ids = tiny_input_ids()
    with torch.no_grad():
        expected, actual = stock(ids).logits, fused(ids).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert len(calls) == (len(modules) if implementation == "eager" else 0)


@pytest.mark.parametrize("model_type", FUSED_TYPES)
def test_greedy_generation_with_cache_matches_stock(checkpoint, model_type):
    path = checkpoint(model_type)
    implementation = "sdpa" if _supports_sdpa(model_type) else "eager"
    stock = load(path, attn_implementation=implementation)
    fused = load(path, model_type, attn_implementation=implementation)
    ids = tiny_input_ids(batch=1)
    settings = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0)
    expected = stock.generate(ids, **settings)
    actual = fused.generate(ids, **settings)
    assert actual.shape[1] == ids.shape[1] + 10
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("model_type", FUSED_TYPES)
def test_attention_weights_are_recorded_during_and_after_the_bundle(checkpoint, model_type):
    path = checkpoint(model_type)
    stock = load(path, attn_implementation="eager")
    ids = tiny_input_ids()
    with torch.no_grad():
        expected = stock(ids, output_attentions=True).attentions
        with layerswap.use_bundle(f"{model_type}-fused_qkv"):
            fused = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
            during = fused(ids, output_attentions=True).attentions
        # Disabling restored the recorders to the stock class; the fused modules subclass it, so they still match.
        after = fused(ids, output_attentions=True).attentions
    assert expected and all(a is not None for a in expected)
    for recorded in (during, after):
        assert len(recorded) == len(expected)
        for actual, reference in zip(recorded, expected, strict=True):
            torch.testing.assert_close(actual, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "olmoe", "qwen2_moe"])
def test_module_call_with_cache_and_deprecated_past_key_values(checkpoint, model_type):
    path = checkpoint(model_type)
    stock, fused = load(path), load(path, model_type)
    stock_attention, fused_attention = stock.model.layers[0].self_attn, fused.model.layers[0].self_attn
    hidden = torch.randn(2, 5, stock.config.hidden_size, generator=torch.Generator().manual_seed(0))
    position_embeddings = stock.model.rotary_emb(hidden, torch.arange(5)[None])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' own notice about past_key_values
        for keyword in ("cache", "past_key_values"):
            caches = [DynamicCache(config=stock.config), DynamicCache(config=stock.config)]
            outputs = [
                attention(hidden, position_embeddings, None, **{keyword: cache})
                for attention, cache in zip((stock_attention, fused_attention), caches, strict=True)
            ]
            torch.testing.assert_close(outputs[1][0], outputs[0][0], atol=1e-5, rtol=1e-5)
            assert len(outputs[1]) == 2
            torch.testing.assert_close(
                caches[1].layers[0].keys, caches[0].layers[0].keys, atol=1e-6, rtol=1e-6
            )
            torch.testing.assert_close(caches[1].layers[0].values, caches[0].layers[0].values)
    # Outside forward, q_proj(x) still gives the stock projection (one extra GEMM, same math).
    expected_q = stock_attention.q_proj(hidden)
    torch.testing.assert_close(fused_attention.q_proj(hidden), expected_q, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3_moe", "olmoe"])
def test_one_gemm_or_three_on_the_fused_weight_give_the_stock_projections(checkpoint, model_type):
    path = checkpoint(model_type)
    stock, fused = load(path), load(path, model_type)
    attention, reference = fused_modules(fused)[0], stock.model.layers[0].self_attn
    attention.fused_gemm_max_rows = 4
    short = torch.randn(1, 4, fused.config.hidden_size)
    long = torch.randn(1, 5, fused.config.hidden_size)
    with torch.no_grad():
        views = attention.project_qkv(short)
        assert len({part.untyped_storage().data_ptr() for part in views}) == 1  # one GEMM, three views
        separate = attention.project_qkv(long)
        assert len({part.untyped_storage().data_ptr() for part in separate}) == 3
        for x, parts in ((short, views), (long, separate)):
            for part, name in zip(parts, ("q_proj", "k_proj", "v_proj"), strict=True):
                torch.testing.assert_close(part, getattr(reference, name)(x), atol=1e-5, rtol=1e-5)
        ids = tiny_input_ids()
        for rows in (0, 10**6):
            for module in fused_modules(fused):
                module.fused_gemm_max_rows = rows
            torch.testing.assert_close(fused(ids).logits, stock(ids).logits, atol=1e-5, rtol=1e-5)


def test_default_cpu_choice_of_one_gemm_by_dtype():
    replacement = fused_qkv_adapter(LlamaAttention, BundleOptions())
    config = AutoConfig.for_model(
        "llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    )

    def storages(module, rows, dtype):
        parts = module.project_qkv(torch.randn(1, rows, 64, dtype=dtype))
        return len({part.untyped_storage().data_ptr() for part in parts})

    with torch.no_grad():
        module = replacement(config, layer_idx=0)
        assert [storages(module, rows, torch.float32) for rows in (1, 2, 3, 64)] == [1, 1, 3, 3]
        module = module.to(torch.bfloat16)
        assert [storages(module, rows, torch.bfloat16) for rows in (1, 256, 257)] == [1, 1, 3]


@pytest.mark.parametrize("long_inputs", [False, True], ids=["one-gemm", "three-gemms"])
def test_backward_through_an_in_place_stock_forward(tmp_path, long_inputs):
    # olmoe's clip_qkv clamps q, k and v in place: on views of one fused tensor that would break autograd.
    overrides = {**fused_qkv_overrides("olmoe"), "clip_qkv": 0.5}
    tiny_model("olmoe", **overrides).save_pretrained(tmp_path)
    stock, fused = load(tmp_path).train(), load(tmp_path, "olmoe").train()
    for module in fused_modules(fused):
        module.fused_gemm_max_rows = 0 if long_inputs else 10**6
    ids = tiny_input_ids()
    for model in (stock, fused):
        model(ids, labels=ids).loss.backward()
    stock_attention, fused_attention = stock.model.layers[0].self_attn, fused.model.layers[0].self_attn
    expected = torch.cat([getattr(stock_attention, n).weight.grad for n in ("q_proj", "k_proj", "v_proj")])
    torch.testing.assert_close(fused_attention.qkv_proj.weight.grad, expected, atol=1e-5, rtol=1e-4)


def test_replacement_is_a_subclass_with_the_stock_signature():
    replacement = fused_qkv_adapter(LlamaAttention, BundleOptions())
    assert issubclass(replacement, LlamaAttention) and replacement._layerswap_original is LlamaAttention
    config = AutoConfig.for_model(
        "llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    )
    module = replacement(config, layer_idx=0)
    assert module.qkv_sizes == (64, 32, 32) and module.qkv_proj.weight.shape == (128, 64)
    assert not {"q_proj", "k_proj", "v_proj"} & {name for name, _ in module.named_modules()}
    with pytest.raises(AttributeError, match="fused `qkv_proj`"):
        module.k_proj = nn.Linear(64, 32)


def test_attention_without_plain_linear_projections_is_refused():
    class MixedBiasAttention(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.q_proj = nn.Linear(8, 8, bias=True)
            self.k_proj = nn.Linear(8, 8, bias=False)
            self.v_proj = nn.Linear(8, 8, bias=False)

        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
            return hidden_states, None

    replacement = fused_qkv_adapter(MixedBiasAttention, BundleOptions())
    with pytest.raises(UnsupportedTransformersError, match=r"MixedBiasAttention.*same bias"):
        replacement(None, 0)


def _bnb_cpu_rejected_linears(model: nn.Module) -> list[str]:
    # bitsandbytes' CPU 4-bit kernel needs out_features % 32 == 0 and in_features >= 64; some stock layers of
    # the tiny configs (laguna's per-head g_proj, jamba's mamba projections) miss that and stay unquantized.
    return [
        name
        for name, m in model.named_modules()
        if type(m) is nn.Linear and (m.out_features % 32 or m.in_features < 64)
    ]


@pytest.mark.parametrize("model_type", FUSED_TYPES)
def test_bnb_4bit_quantizes_qkv_proj_with_and_without_quant_bundle(checkpoint, model_type):
    bnb = pytest.importorskip("bitsandbytes")
    path = checkpoint(model_type)
    skip = _bnb_cpu_rejected_linears(load(path))
    assert not any(name.endswith(("q_proj", "k_proj", "v_proj")) for name in skip)
    # Both enable orders of the two bundles, alternating over the families.
    extra = [f"{model_type}-quant"] if f"{model_type}-quant" in CATALOG else []
    names = [f"{model_type}-fused_qkv", *extra][:: -1 if FUSED_TYPES.index(model_type) % 2 else 1]
    quantization = BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=skip or None)
    with layerswap.use_bundle(*names):
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization).eval()
    modules = fused_modules(model)
    assert modules and all(isinstance(m.qkv_proj, bnb.nn.Linear4bit) for m in modules)
    with torch.no_grad():
        logits = model(tiny_input_ids()).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("model_type", CORE_TYPES)
def test_tensor_parallel_plan_shards_qkv_proj_head_wise(checkpoint, model_type):
    # The stock colwise q/k/v entries become one colwise qkv_proj entry (the 2-rank numerics are in
    # tests/test_distributed.py); the rest of the attention's entries (o_proj, q/k norms) are stock's.
    path = checkpoint(model_type)
    stock_plan, _, _ = load(path)._resolve_parallel_plans(DistributedConfig(tp_size=2))
    with layerswap.use_bundle(f"{model_type}-fused_qkv"):
        fused = AutoModelForCausalLM.from_pretrained(path)
        plan, _, _ = fused._resolve_parallel_plans(DistributedConfig(tp_size=2))
        # Without tensor parallelism there is no plan.
        assert fused._resolve_parallel_plans(DistributedConfig(tp_size=1))[0] == {}
    attention = "model.layers.0.self_attn"
    stock_style = stock_plan[f"{attention}.q_proj.weight"]
    if stock_style == "colwise":
        assert plan[f"{attention}.qkv_proj.weight"] == "colwise"
    else:  # olmoe gathers q, k and v for its full-width norms: an unsharded qkv_proj computes them whole
        assert stock_style == "colwise_gather_output" and f"{attention}.qkv_proj.weight" not in plan
    projections = tuple(f"{attention}.{p}" for p in ("q_proj", "k_proj", "v_proj"))
    assert not any(name.startswith(projections) for name in plan)
    kept = {k: v for k, v in stock_plan.items() if not re.search(r"\.[qkv]_proj(\.|$)", k)}
    assert kept.items() <= plan.items()


def test_tensor_parallel_size_that_splits_a_head_is_refused_naming_the_sizes(tmp_path):
    # 6 query and 3 key/value heads: two ranks would split a key/value head.
    tiny_model("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3).save_pretrained(
        tmp_path
    )
    with layerswap.use_bundle("llama-fused_qkv"):
        fused = AutoModelForCausalLM.from_pretrained(tmp_path)
        assert fused._resolve_parallel_plans(DistributedConfig(tp_size=3))[0]  # 3 divides both: fine
        with pytest.raises(
            FusedQKVParallelismError,
            match=r"over 2 ranks .* 6 query, 3 key and 3 value heads of 16 .* divides 6 and 3",
        ):
            fused._resolve_parallel_plans(DistributedConfig(tp_size=2))


def test_tensor_parallel_plan_in_another_style_than_colwise_is_refused(checkpoint):
    with layerswap.use_bundle("llama-fused_qkv"):
        fused = AutoModelForCausalLM.from_pretrained(checkpoint("llama"))
        fused._tp_plan = {**fused._tp_plan, "model.layers.*.self_attn.qkv_proj": "rowwise"}
        with pytest.raises(FusedQKVParallelismError, match=r"qkv_proj as \['rowwise'\].*'colwise'"):
            fused._resolve_parallel_plans(DistributedConfig(tp_size=2))


class _FakeMesh:
    def get_mesh(self, names):
        return None


def test_from_pretrained_with_a_tensor_parallel_size_that_splits_a_head_fails_before_sharding(tmp_path):
    tiny_model("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3).save_pretrained(
        tmp_path
    )
    with (
        layerswap.use_bundle("llama-fused_qkv"),
        mock.patch.object(distributed_mixin, "initialize_distributed_mesh", return_value=(None, _FakeMesh())),
        mock.patch.object(distributed_mixin, "apply_tensor_parallelism") as shard,
        pytest.raises(FusedQKVParallelismError, match="llama-fused_qkv"),
    ):
        AutoModelForCausalLM.from_pretrained(
            tmp_path, distributed_config=DistributedConfig(tp_size=2, tp_plan="auto")
        )
    shard.assert_not_called()


def test_parallel_plan_guard_is_shared_and_restored_exactly():
    assert_wrapper_shared_and_restored(
        DistributedMixin, "_resolve_parallel_plans", ("llama-fused_qkv", "qwen3-fused_qkv")
    )


@pytest.mark.parametrize("offload", [False, True], ids=["cpu", "disk"])
@pytest.mark.parametrize("model_type", CORE_TYPES)
def test_device_map_auto(checkpoint, tmp_path, model_type, offload):
    pytest.importorskip("accelerate")
    path = checkpoint(model_type)
    stock = load(path)
    # With no CPU memory to spare, accelerate offloads the weights to disk and streams them in through hooks.
    placement = {"max_memory": {"cpu": 1}, "offload_folder": tmp_path} if offload else {}
    fused = load(path, model_type, device_map="auto", **placement)
    assert fused_modules(fused)
    if offload:
        assert "disk" in fused.hf_device_map.values()
        for module in fused_modules(fused):
            # The prefill path must still call qkv_proj (through accelerate's hook), not read its meta weight.
            module.fused_gemm_max_rows = 0
    ids = tiny_input_ids()
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, stock(ids).logits, atol=1e-5, rtol=1e-5)
