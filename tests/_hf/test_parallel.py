"""_hf.parallel on one process: the shard-on-read wrapper the '-quant' bundles install, local_shard, and the
expert-parallel refusals and plans. The sharded loads themselves run on two ranks in tests/test_distributed.py."""

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_utils import PreTrainedModel

import layerswap
from _support.global_state import assert_wrapper_shared_and_restored
from _support.tiny_models import tiny_model
from layerswap import ExpertParallelismError
from layerswap._hf import parallel

sharding_utils = pytest.importorskip("transformers.distributed.sharding_utils")
DtensorShardOperation = sharding_utils.DtensorShardOperation
distributed_mixin = pytest.importorskip("transformers.distributed.mixin")
DistributedConfig = pytest.importorskip("transformers.distributed").DistributedConfig


def test_shard_on_read_wrapper_is_shared_and_restored_exactly():
    assert_wrapper_shared_and_restored(
        DtensorShardOperation, "shard_tensor", ("qwen3_moe-quant", "mixtral-quant")
    )


def test_a_source_with_more_dimensions_than_its_parameter_is_read_whole():
    # A fused [E, 2I, H] experts tensor loading into one expert's [I, H] weight: transformers would cut it by the
    # weight's placements (along the experts axis); the conversion needs it whole, and cuts what it makes.
    calls = []

    def stock(self, source, tensor_idx=None, device=None, dtype=None):
        calls.append(tuple(source.shape))
        return source[:1]

    shard_tensor = parallel._whole_when_fused(stock)
    operation = SimpleNamespace(param_ndim=2)
    fused = torch.arange(24.0).view(2, 3, 4)
    read = shard_tensor(operation, fused, tensor_idx=0, dtype=torch.float64)
    assert torch.equal(read, fused.double()) and read.dtype == torch.float64 and not calls
    # Sources laid out like the parameter (or one expert of a 3D one) are cut as transformers cuts them.
    weight = torch.ones(4, 4)
    assert torch.equal(shard_tensor(operation, weight), weight[:1]) and calls == [(4, 4)]


def test_local_shard_of_an_unsharded_parameter_is_the_tensor_itself():
    tensor = torch.randn(4, 3)
    assert parallel.local_shard(torch.nn.Parameter(torch.zeros(4, 3)), tensor) is tensor


# --- expert parallelism ----------------------------------------------------------------------------------------


class _FakeMesh:
    def get_mesh(self, names):
        return None


def _three_experts(tmp_path, model_type):
    path = tmp_path / model_type
    tiny_model(model_type, num_experts=3, num_local_experts=3).save_pretrained(path)
    return path


@pytest.mark.parametrize("bundle", ["qwen3_moe-quant", "qwen3_moe-fast", "mixtral-quant", "mixtral-fast"])
def test_an_expert_parallel_size_that_does_not_divide_the_experts_fails_before_sharding_or_loading(
    tmp_path, bundle
):
    # 3 experts cannot be split into whole experts over 2 ranks. Stock transformers raises ValueError once it starts
    # sharding (-fast); -quant's experts used to stay whole on every rank. Refused when the plans are resolved.
    model_type = bundle.split("-")[0]
    path = _three_experts(tmp_path, model_type)
    with (
        layerswap.use_bundle(bundle),
        mock.patch.object(distributed_mixin, "initialize_distributed_mesh", return_value=(None, _FakeMesh())),
        mock.patch.object(distributed_mixin, "apply_tensor_parallelism") as shard,
        mock.patch.object(distributed_mixin, "apply_expert_parallelism") as split,
        mock.patch.object(PreTrainedModel, "_load_pretrained_model") as load,
        pytest.raises(ExpertParallelismError) as refused,
    ):
        AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2, ep_size=2))
    shard.assert_not_called(), split.assert_not_called(), load.assert_not_called()
    message = str(refused.value)
    assert "model.layers.0.mlp.experts" in message and "num_experts=3" in message and "ep_size=2" in message
    assert "Use an ep_size that divides 3 (1, 3), or tensor parallelism without ep_size" in message
    assert isinstance(refused.value, ValueError)  # as stock's own refusal


def test_quant_experts_keep_the_expert_parallel_dispatch_and_drop_the_stacked_parameters_entries(tmp_path):
    path = tmp_path / "qwen3_moe"
    tiny_model("qwen3_moe").save_pretrained(path)
    with layerswap.use_bundle("qwen3_moe-quant"):
        model = AutoModelForCausalLM.from_pretrained(path)
        _, ep_plan, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=2, ep_size=2))
    experts = "model.layers.0.mlp.experts"
    assert ep_plan[experts] == "ep_dispatch_experts"
    assert not [name for name in ep_plan if name.startswith(experts + ".")]
