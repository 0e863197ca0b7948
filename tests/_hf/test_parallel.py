"""_hf.parallel on one process: the shard-on-read wrapper the '-quant' bundles install, and local_shard. The
sharded loads themselves run on two ranks in tests/test_distributed.py."""

from types import SimpleNamespace

import pytest
import torch

from _support.global_state import assert_wrapper_shared_and_restored
from layerswap._hf import parallel

sharding_utils = pytest.importorskip("transformers.distributed.sharding_utils")
DtensorShardOperation = sharding_utils.DtensorShardOperation


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
