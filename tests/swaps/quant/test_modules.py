"""LinearExperts against the stock Experts module it replaces, for every family in the table."""

import contextlib
import importlib

import pytest
import torch
from torch import nn

from _support.families import MOE_FAMILIES
from _support.tiny_models import tiny_config
from _support.transformers_support import needs_model_type
from layerswap._hf import compat as _compat
from layerswap._hf.experts import STOCK_LAYOUT_FLAGS
from layerswap.bundle import BundleOptions
from layerswap.errors import ExpertParallelismError, UnsupportedTransformersError
from layerswap.swaps.quant.modules import (
    LinearExperts,
    LinearPostNormExperts,
    RemoteExpert,
    linear_experts_adapter,
)


def _stock_and_linear(family):
    module = importlib.import_module(family.modeling_module)
    stock_cls = getattr(module, family.experts)
    config = tiny_config(family.model_type).get_text_config()
    torch.manual_seed(0)
    stock = stock_cls(config)
    for parameter in stock.parameters():
        nn.init.normal_(parameter, std=0.1)
    linear = linear_experts_adapter(f"{family.model_type}-quant", family.model_types)(
        stock_cls, BundleOptions()
    )(config)
    names = linear.expert_names
    with torch.no_grad():
        for index, expert in enumerate(linear):
            gate, up = stock.gate_up_proj[index].chunk(2, dim=0)
            getattr(expert, names.gate).weight.copy_(gate)
            getattr(expert, names.up).weight.copy_(up)
            getattr(expert, names.down).weight.copy_(stock.down_proj[index])
    return stock, linear, config


def _routing(tokens, num_experts, top_k, seed=0):
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator).softmax(-1)
    return index, weights


# The stock fused layout, whose weights this test copies by hand; every other layout (transposed, biased, gate-less,
# dbrx's) is compared with stock through its conversion, on logits (test_conversion, test_end_to_end).
@pytest.mark.parametrize("family", [f for f in MOE_FAMILIES if f.is_stock_layout], ids=lambda f: f.model_type)
def test_linear_experts_match_stock_experts(family):
    stock, linear, _ = _stock_and_linear(family)
    hidden = torch.randn(11, linear.hidden_dim)
    index, weights = _routing(11, linear.num_experts, 2)
    torch.testing.assert_close(
        linear(hidden, index, weights), stock(hidden, index, weights), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("family", MOE_FAMILIES[:3], ids=lambda f: f.model_type)
def test_every_projection_is_an_exact_nn_linear(family):
    # bitsandbytes only replaces modules whose type is exactly nn.Linear; a subclass would stay unquantized.
    _, linear, _ = _stock_and_linear(family)
    projections = [
        m for expert in linear for m in expert.children() if not isinstance(m, type(expert.act_fn))
    ]
    assert len(projections) == 3 * linear.num_experts
    assert all(type(m) is nn.Linear and m.bias is None for m in projections)
    assert isinstance(linear, nn.ModuleList)


def test_linear_experts_do_not_subclass_the_stock_class():
    # _init_weights checks isinstance(module, <stock Experts>) and then initialises gate_up_proj.
    family = MOE_FAMILIES[0]
    stock, linear, _ = _stock_and_linear(family)
    assert not isinstance(linear, type(stock))


def test_expert_parallel_sentinel_index_is_skipped():
    # Index E marks "expert not on this rank" under expert parallelism; stock skips it, so must we.
    stock, linear, _ = _stock_and_linear(MOE_FAMILIES[0])
    if not hasattr(stock, "_is_expert_parallel"):
        pytest.skip(
            f"stock experts in transformers {_compat.TRANSFORMERS_VERSION} have no expert-parallel sentinel "
            f"(_is_expert_parallel, from {STOCK_LAYOUT_FLAGS['_is_expert_parallel'][1]})"
        )
    hidden = torch.randn(5, linear.hidden_dim)
    index, weights = _routing(5, linear.num_experts, 2)
    index[0, 0] = linear.num_experts
    torch.testing.assert_close(
        linear(hidden, index, weights), stock(hidden, index, weights), atol=1e-5, rtol=1e-5
    )


def _split_by_expert(linear, rank, size):
    """A copy of `linear` as rank `rank` of `size` holds it under expert parallelism."""
    import copy

    part = copy.deepcopy(linear)
    part._layerswap_shard_experts(rank, size)
    return part


def _local_routes(index, weights, held):
    # What transformers' all-reduce dispatch hands a rank: its experts' local ids, every other route as the
    # sentinel id (the local count) with weight 0.
    off_rank = (index < held.start) | (index >= held.stop)
    return index.where(off_rank, index - held.start).masked_fill(off_rank, len(held)), weights.masked_fill(
        off_rank, 0.0
    )


def test_experts_split_by_expert_hold_only_their_own_and_sum_to_the_whole():
    # Under expert parallelism each rank keeps a contiguous block of whole experts (as transformers splits stacked
    # experts); the others are weightless stand-ins, and the ranks' partial outputs sum to the whole output.
    stock, linear, _ = _stock_and_linear(MOE_FAMILIES[0])
    hidden = torch.randn(9, linear.hidden_dim)
    index, weights = _routing(9, linear.num_experts, 2)
    total = sum(p.numel() for p in linear.parameters())
    parts = [_split_by_expert(linear, rank, 2) for rank in range(2)]
    assert [part._layerswap_held_experts for part in parts] == [range(0, 4), range(4, 8)]
    assert [part.num_experts for part in parts] == [4, 4] and parts[1].num_global_experts == 8
    assert [sum(p.numel() for p in part.parameters()) for part in parts] == [total // 2] * 2
    assert isinstance(parts[0][5], RemoteExpert) and isinstance(parts[1][2], RemoteExpert)
    down = linear.expert_names.down
    assert torch.equal(getattr(parts[1][4], down).weight, getattr(linear[4], down).weight)
    outputs = [part(hidden, *_local_routes(index, weights, part._layerswap_held_experts)) for part in parts]
    torch.testing.assert_close(sum(outputs), stock(hidden, index, weights), atol=1e-5, rtol=1e-5)


def test_an_expert_held_by_another_rank_cannot_run():
    _, linear, _ = _stock_and_linear(MOE_FAMILIES[0])
    part = _split_by_expert(linear, 1, 2)
    with pytest.raises(RuntimeError, match="expert 0 is held by rank 0 under expert parallelism"):
        part[0](torch.randn(2, linear.hidden_dim))


def test_expert_parallelism_is_refused_where_experts_cannot_be_split_by_expert():
    _, linear, _ = _stock_and_linear(MOE_FAMILIES[0])
    linear._layerswap_check_expert_parallel("model.layers.0.mlp.experts", 2, 1)  # fine
    with pytest.raises(
        ExpertParallelismError, match=r"dp_size=2\).*DistributedConfig\(tp_size=N, ep_size=N\)"
    ):
        linear._layerswap_check_expert_parallel("model.layers.0.mlp.experts", 2, 2)
    linear._layerswap_expert_parallel_refusal = "a reason"
    with pytest.raises(ExpertParallelismError, match=r"by expert: a reason\. Use tensor parallelism instead"):
        linear._layerswap_check_expert_parallel("model.layers.0.mlp.experts", 2, 1)


def test_experts_without_tokens_and_gradients_flow():
    stock, linear, _ = _stock_and_linear(MOE_FAMILIES[0])
    hidden = torch.randn(4, linear.hidden_dim, requires_grad=True)
    index = torch.zeros(4, 2, dtype=torch.long)  # every token to experts 0 and 1, the rest get none
    index[:, 1] = 1
    weights = torch.full((4, 2), 0.5)
    out = linear(hidden, index, weights)
    torch.testing.assert_close(out, stock(hidden, index, weights), atol=1e-5, rtol=1e-5)
    out.sum().backward()
    gate = linear.expert_names.gate
    assert getattr(linear[0], gate).weight.grad is not None
    assert getattr(linear[2], gate).weight.grad is None


def test_a_layout_no_adapter_reproduces_is_refused_with_the_class_name_flags_and_shapes():
    # A down_proj whose shape does not fit gate_up_proj: no forward LinearExperts could compute would be stock's.
    class OddExperts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.empty(4, 32, 64))
            self.down_proj = nn.Parameter(torch.empty(4, 64, 48))
            self.act_fn = nn.SiLU()

    adapter = linear_experts_adapter("qwen2_moe-quant", ("qwen2_moe",))(OddExperts, BundleOptions())
    with pytest.raises(
        UnsupportedTransformersError,
        match=r"OddExperts.*layout flags.*down_proj': \(4, 64, 48\).*own adapter",
    ):
        adapter(None)


@needs_model_type("muse_spark")
def test_experts_with_a_post_expert_norm_match_stock():
    # muse_spark normalizes each expert's output (one shared norm, before the routing weight); a random norm
    # weight makes a missing or misplaced norm show.
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts

    family = next(f for f in MOE_FAMILIES if f.model_type == "muse_spark")
    config = tiny_config("muse_spark").get_text_config()
    stock = MuseSparkExperts(config)
    for parameter in stock.parameters():
        nn.init.normal_(parameter, std=0.3)
    linear = linear_experts_adapter("muse_spark-quant", ("muse_spark",), family.flags)(
        MuseSparkExperts, BundleOptions()
    )(config)
    assert isinstance(linear, LinearPostNormExperts) and len(linear) == linear.num_experts == len(
        list(linear)
    )
    with torch.no_grad():
        linear.post_expert_norm.weight.copy_(stock.post_expert_norm.weight)
        for index, expert in enumerate(linear):
            gate, up = stock.gate_up_proj[index].chunk(2, dim=0)
            expert.gate_proj.weight.copy_(gate)
            expert.up_proj.weight.copy_(up)
            expert.down_proj.weight.copy_(stock.down_proj[index])
    assert [n for n, _ in linear.named_parameters() if "norm" in n] == [
        "post_expert_norm.weight"
    ]  # saved once
    hidden = torch.randn(9, linear.hidden_dim)
    index, weights = _routing(9, linear.num_experts, 2)
    torch.testing.assert_close(
        linear(hidden, index, weights), stock(hidden, index, weights), atol=1e-5, rtol=1e-5
    )
    with pytest.raises(UnsupportedTransformersError, match="applies a norm after each expert"):
        linear_experts_adapter("muse_spark-quant", ("muse_spark",))(MuseSparkExperts, BundleOptions())(config)


def test_class_name_says_what_it_replaces():
    _, linear, _ = _stock_and_linear(MOE_FAMILIES[0])
    assert type(linear).__name__ == "LinearQwen2MoeExperts"
    assert type(linear)._layerswap_original.__name__ == "Qwen2MoeExperts"
    assert isinstance(linear, LinearExperts)


# A custom _apply_gate (deepseek_v4's and hy_v4's clamped SwiGLU, step3p7's per-layer one) changes what each expert
# computes: LinearExperts must compute it too. The limit is set low enough that the clamp changes the outputs (a tiny
# random model with the default limit would never reach it, and a LinearExperts ignoring the gate would pass).
@pytest.mark.parametrize(
    ("model_type", "experts_class", "config_limit", "constructor_limit"),
    [
        ("deepseek_v4", "DeepseekV4Experts", {"swiglu_limit": 0.05}, {}),
        # The limit is the layer's entry of swiglu_limits, passed to the constructor by the MoE block.
        pytest.param(
            "step3p7", "Step3p7Experts", {}, {"swiglu_limit": 0.05}, marks=needs_model_type("step3p7")
        ),
    ],
)
def test_experts_with_their_own_gate_keep_computing_it(
    model_type, experts_class, config_limit, constructor_limit
):
    original = getattr(
        importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}"), experts_class
    )
    config = tiny_config(model_type, **config_limit).get_text_config()
    stock = original(config, **constructor_limit)
    for parameter in stock.parameters():
        torch.nn.init.normal_(parameter, std=0.5)
    linear = linear_experts_adapter(f"{model_type}-quant", (model_type,))(original, BundleOptions())(
        config, **constructor_limit
    )
    names = linear.expert_names
    for e, expert in enumerate(linear):
        gate, up = stock.gate_up_proj.data[e].chunk(2, dim=0)
        getattr(expert, names.gate).weight.data.copy_(gate)
        getattr(expert, names.up).weight.data.copy_(up)
        getattr(expert, names.down).weight.data.copy_(stock.down_proj.data[e])
    hidden = torch.randn(6, linear.hidden_dim)
    index, weights = _routing(6, linear.num_experts, 2)
    expected = stock(hidden, index, weights)
    stock.limit = float("inf")
    assert not torch.allclose(stock(hidden, index, weights), expected, atol=1e-3)  # the clamp matters here
    torch.testing.assert_close(linear(hidden, index, weights), expected, atol=1e-5, rtol=1e-5)


@needs_model_type("jetmoe")
def test_parallel_experts_match_stock_with_experts_that_get_no_rows():
    # jetmoe's JetMoeParallelExperts takes rows grouped by expert and one count per expert; experts with a count of
    # 0 (here 1 and 4) must be skipped, as quantized layers fail on empty inputs.
    from transformers.models.jetmoe.modeling_jetmoe import JetMoeParallelExperts

    stock = JetMoeParallelExperts(6, 64, 96)
    nn.init.normal_(stock.weight, std=0.1)
    linear = linear_experts_adapter("jetmoe-quant", ("jetmoe",))(JetMoeParallelExperts, BundleOptions())(
        6, 64, 96
    )
    with torch.no_grad():
        for index, expert in enumerate(linear):
            expert.weight.copy_(stock.weight[index])
    assert all(type(expert) is nn.Linear and expert.bias is None for expert in linear)
    expert_size = [3, 0, 2, 5, 0, 1]
    rows = torch.randn(sum(expert_size), 64)
    torch.testing.assert_close(linear(rows, expert_size), stock(rows, expert_size), atol=1e-5, rtol=1e-5)
    assert linear(rows[:0], [0] * 6).shape == (0, 96)


@needs_model_type("longcat_flash")
def test_identity_experts_pass_their_rows_through_weighted():
    # longcat_flash routes to 8 real experts and 4 identity ones (indices 8..11): token 0 only to identity experts,
    # token 1 to one of each, token 2 to real ones only.
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts

    config = tiny_config("longcat_flash")
    stock = LongcatFlashExperts(config)
    for parameter in stock.parameters():
        nn.init.normal_(parameter, std=0.1)
    linear = linear_experts_adapter("longcat_flash-quant", ("longcat_flash",))(
        LongcatFlashExperts, BundleOptions()
    )(config)
    assert linear.num_experts == 8 and linear.num_identity_experts == 4 and len(linear) == 12
    with torch.no_grad():
        for index, expert in enumerate(linear):
            gate, up = stock.gate_up_proj[index].chunk(
                2, dim=0
            )  # the identity experts' rows too: saved back whole
            expert.gate_proj.weight.copy_(gate)
            expert.up_proj.weight.copy_(up)
            if index < 8:
                expert.down_proj.weight.copy_(stock.down_proj[index])
    hidden = torch.randn(3, linear.hidden_dim)
    index = torch.tensor([[9, 11], [2, 10], [0, 5]])
    weights = torch.rand(3, 2)
    torch.testing.assert_close(
        linear(hidden, index, weights), stock(hidden, index, weights), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(linear(hidden, index, weights)[0], hidden[0] * weights[0].sum())


# --- no-grad CPU calls on the measured engines ---------------------------------------------------------------------

# The engines a no-grad CPU call may run plain experts on instead of their three nn.Linear calls; the machine's
# measurement picks among them (tests/kernels/test_cpu_dispatch.py), here each one is forced.
ENGINE_FAMILIES = [f for f in MOE_FAMILIES if f.is_stock_layout][:3]


@pytest.fixture
def forced_engine(monkeypatch):
    from layerswap.kernels import cpu_dispatch

    def force(engine: str) -> None:
        monkeypatch.setenv(cpu_dispatch.ENV_STRATEGY, f"layerswap:{engine}")
        cpu_dispatch.clear_memory_cache()

    yield force
    cpu_dispatch.clear_memory_cache()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("engine", ["mv", "wm", "skinny"])
@pytest.mark.parametrize("family", ENGINE_FAMILIES, ids=lambda f: f.model_type)
def test_no_grad_calls_on_each_engine_match_stock(family, engine, dtype, forced_engine, monkeypatch):
    forced_engine(engine)
    calls = _engine_calls(monkeypatch)
    stock, linear, _ = _stock_and_linear(family)
    stock, linear = stock.to(dtype), linear.to(dtype)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    for tokens in (1, 11):  # one row per expert (the GEMV), then several
        hidden = torch.randn(tokens, linear.hidden_dim).to(dtype)
        index, weights = _routing(tokens, linear.num_experts, 2, seed=tokens)
        with torch.no_grad():
            got, want = linear(hidden, index, weights), stock(hidden, index, weights)
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    assert calls and set(calls) == {engine}  # every expert took the forced engine


def _engine_calls(monkeypatch):
    from layerswap.kernels import torch_moe

    calls = []
    real = torch_moe.linear_expert_mlp
    monkeypatch.setattr(torch_moe, "linear_expert_mlp", lambda *a: calls.append(a[-1]) or real(*a))
    # SiLU experts on layerswap's kernel run together, in one call: one "skinny" per expert in it.
    real_batch = torch_moe.linear_experts_on_kernel

    def on_kernel(rows, weights, bounds, out):
        calls.extend(["skinny"] * len(weights))
        return real_batch(rows, weights, bounds, out)

    monkeypatch.setattr(torch_moe, "linear_experts_on_kernel", on_kernel)
    return calls


def _all_experts_busy(linear, tokens=16):
    hidden = torch.randn(tokens, linear.hidden_dim)
    index = torch.arange(tokens * 2).remainder(linear.num_experts).view(tokens, 2)  # every expert gets rows
    return hidden, index, torch.rand(tokens, 2)


class _QuantizedLinear(nn.Linear):
    """What a quantizer's replacement looks like to this code (quanto's QLinear): not exactly nn.Linear."""


def _subclass(expert, names):
    linear = getattr(expert, names.gate)
    replacement = _QuantizedLinear(linear.in_features, linear.out_features, bias=False)
    replacement.weight = linear.weight
    setattr(expert, names.gate, replacement)


def _instance_forward(expert, names):  # accelerate's offloading replaces forward on the instance
    linear = getattr(expert, names.up)
    linear.forward = nn.Linear.forward.__get__(linear)


def _scales_beside_the_weight(expert, names):  # a quantizer that keeps nn.Linear and adds its scales
    getattr(expert, names.down).register_buffer("weight_scale", torch.ones(1))


def _parametrized(expert, names):
    torch.nn.utils.parametrize.register_parametrization(getattr(expert, names.up), "weight", nn.Identity())


def _tensor_subclass_weight(expert, names):  # torchao's quantized weights are tensor subclasses
    class Subclass(torch.Tensor):
        pass

    linear = getattr(expert, names.gate)
    linear.weight = nn.Parameter(linear.weight.detach().as_subclass(Subclass), requires_grad=False)


# Anything that observes, replaces or changes a projection's call keeps its expert on the module path; the other
# experts of the same call take the forced engine.
OBSERVERS = {
    "forward_hook_on_a_projection": lambda e, n: getattr(e, n.up).register_forward_hook(lambda *a: None),
    "pre_hook_on_a_projection": lambda e, n: getattr(e, n.down).register_forward_pre_hook(lambda *a: None),
    "hook_on_the_expert": lambda e, n: e.register_forward_hook(lambda *a: None),
    "quantized_subclass": _subclass,
    "forward_set_on_the_instance": _instance_forward,
    "buffers_beside_the_weight": _scales_beside_the_weight,
    "parameter_beside_the_weight": lambda e, n: getattr(e, n.up).register_parameter(
        "weight_scale", nn.Parameter(torch.ones(1))
    ),
    "bias": lambda e, n: setattr(
        getattr(e, n.down), "bias", nn.Parameter(torch.zeros(getattr(e, n.down).out_features))
    ),
    "parametrization": _parametrized,
    "tensor_subclass_weight": _tensor_subclass_weight,
    "compiled_module": lambda e, n: setattr(getattr(e, n.gate), "_compiled_call_impl", lambda *a: None),
}


@pytest.mark.parametrize("engine", ["wm", "skinny"])  # skinny: the plain experts run in one kernel call
@pytest.mark.parametrize("observer", list(OBSERVERS))
def test_an_observed_or_changed_expert_runs_its_modules(observer, engine, forced_engine, monkeypatch):
    forced_engine(engine)
    calls = _engine_calls(monkeypatch)
    _, linear, _ = _stock_and_linear(ENGINE_FAMILIES[0])
    OBSERVERS[observer](linear[0], linear.expert_names)
    if (
        observer == "compiled_module"
    ):  # its compiled call would run instead of forward: see that it is asked for
        compiled = getattr(linear[0], linear.expert_names.gate)
        seen = []
        compiled._compiled_call_impl = lambda *a, **k: (
            seen.append(a[0].shape[0]) or nn.Linear.forward(compiled, *a)
        )
    with torch.no_grad():
        linear(*_all_experts_busy(linear))
    assert len(calls) == linear.num_experts - 1  # every expert but the observed one on the forced engine
    if observer == "compiled_module":
        assert seen


def test_a_hook_sees_exactly_its_experts_rows(forced_engine, monkeypatch):
    forced_engine("wm")
    _, linear, _ = _stock_and_linear(ENGINE_FAMILIES[0])
    seen = []
    getattr(linear[0], linear.expert_names.up).register_forward_hook(
        lambda m, args, out: seen.append(args[0])
    )
    hidden, index, weights = _all_experts_busy(linear)
    with torch.no_grad():
        linear(hidden, index, weights)
    tokens_of_expert_0 = (index == 0).any(-1).nonzero().squeeze(-1)
    assert len(seen) == 1 and torch.equal(seen[0], hidden[tokens_of_expert_0])


class _PassThroughMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("context", ["gradients", "global_hook", "autocast", "function_mode"])
def test_calls_that_must_see_every_module_run_them_all(context, forced_engine, monkeypatch):
    forced_engine("wm")
    calls = _engine_calls(monkeypatch)
    _, linear, _ = _stock_and_linear(ENGINE_FAMILIES[0])
    inputs = _all_experts_busy(linear)
    with contextlib.ExitStack() as stack:
        if context != "gradients":
            stack.enter_context(torch.no_grad())
        if context == "global_hook":
            handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
            stack.callback(handle.remove)
        if context == "autocast":  # nn.Linear's F.linear runs in bf16 under autocast; the engines would not
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        if context == "function_mode":  # a mode that intercepts F.linear must see every call
            stack.enter_context(_PassThroughMode())
        linear(*inputs)
    assert calls == []


def test_layers_with_no_plain_expert_are_not_scanned_on_every_call(forced_engine, monkeypatch):
    from layerswap.kernels import cpu_dispatch

    monkeypatch.delenv(cpu_dispatch.ENV_STRATEGY, raising=False)
    monkeypatch.setenv(cpu_dispatch.ENV_CALIBRATION, "1")
    monkeypatch.setenv(cpu_dispatch.ENV_CACHE_DIR, "/nonexistent/layerswap-test-cache")  # nothing written
    cpu_dispatch.clear_memory_cache()
    _, linear, _ = _stock_and_linear(ENGINE_FAMILIES[0])
    for expert in linear:
        _subclass(expert, linear.expert_names)
    scans = []
    real = type(linear[0]).plain_projections
    monkeypatch.setattr(
        type(linear[0]), "plain_projections", lambda self, dtype: scans.append(1) or real(self, dtype)
    )
    with torch.no_grad():
        for _ in range(3):
            linear(*_all_experts_busy(linear))
    assert len(scans) == linear.num_experts  # one look at every expert, on the first call only

    # That decision is the layer's own: a plain layer of the same shape, later in the same process, is measured.
    from layerswap.kernels.torch_moe import ROW_CLASSES

    monkeypatch.setattr(cpu_dispatch, "_fastest_engines", lambda *a: (("wm",) * ROW_CLASSES, {}))
    calls = _engine_calls(monkeypatch)
    _, plain, _ = _stock_and_linear(ENGINE_FAMILIES[0])
    with torch.no_grad():
        plain(*_all_experts_busy(plain))
    assert calls and set(calls) == {"wm"}


def test_unforced_calls_without_calibration_run_nn_linear_bitwise(monkeypatch):
    # tests/conftest.py turns calibration off: then no-grad calls are exactly the module path, bit for bit.
    calls = _engine_calls(monkeypatch)
    _, linear, _ = _stock_and_linear(ENGINE_FAMILIES[0])
    hidden = torch.randn(9, linear.hidden_dim)
    index, weights = _routing(9, linear.num_experts, 2)
    with torch.no_grad():
        got = linear(hidden, index, weights)
    assert calls == []
    assert torch.equal(got, linear(hidden, index, weights).detach())
