"""What the fused-MoE kernels are configured by, below every backend: the input error they raise, the activation
codes the Triton kernels switch on, and the Triton tile configs per token-count bucket. It imports only the
activation names, so the dispatcher (`dispatch`) and the Triton kernels (`triton_moe`) both import it and neither
imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from .torch_moe import ACTIVATIONS

# Integer codes the Triton kernels switch on (a constexpr), one per name in torch_moe.ACTIVATIONS.
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_pytorch_tanh": 2, "relu": 3}
assert set(ACTIVATION_CODES) == set(ACTIVATIONS)


class KernelInputError(ValueError):
    """Tensors, activation or backend that the fused-MoE kernels cannot take. The kernels import nothing of
    layerswap above them, so this is a ValueError of their own, not a BundleError."""


def activation_code(activation: str) -> int:
    return ACTIVATION_CODES[activation]


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of both grouped GEMMs. `block_n` is the width of the gate tile (and of the up tile beside it)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8  # row blocks per launch group (L2 reuse of gathered rows); irrelevant at decode
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            # tl.dot needs every dimension >= 16, and tl.arange a power of two.
            if value < 16 or value & (value - 1):
                raise KernelInputError(f"TileConfig.{name} must be a power of two >= 16, got {value}")
        if self.group_m < 1:
            raise KernelInputError(f"TileConfig.group_m must be >= 1, got {self.group_m}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise KernelInputError(
                f"TileConfig.num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}"
            )
        if self.num_stages < 1:
            raise KernelInputError(f"TileConfig.num_stages must be >= 1, got {self.num_stages}")


# Safe defaults per token-count bucket (not tuned on a GPU yet; see _TUNED_CONFIGS). Decode is bound by
# reading the weights: BLOCK_M = 16 wastes the least padding (one block per active expert) and a narrow
# BLOCK_N spreads the few active experts over more programs, to keep every SM loading. Prefill is
# compute-bound: a larger BLOCK_M reuses each weight tile across more rows. BLOCK_N stays at 64 because GEMM1
# holds two fp32 accumulators (gate and up). Shared memory per program, (BM*BK + 2*BK*BN) * bytes * stages,
# stays under ~82 KB for 16-bit inputs and, with the launcher's fp32 cap of 2 stages, for fp32 too, so the
# defaults fit GPUs with 100 KB of shared memory per SM (sm_86/sm_89) as well as A100/H100.
_DEFAULT_CONFIGS: dict[str, TileConfig] = {
    "le16": TileConfig(block_m=16, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4),
    "le128": TileConfig(block_m=16, block_n=64, block_k=64, group_m=1, num_warps=4, num_stages=4),
    "le1024": TileConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3),
    "gt1024": TileConfig(block_m=128, block_n=64, block_k=32, num_warps=8, num_stages=3),
}

# Tuned entries, keyed by (num_experts, intermediate size, torch.cuda.get_device_name(), bucket).
# Empty on purpose: no entry is added without a measurement on that GPU (benchmarks/gpu_check.sh).
_TUNED_CONFIGS: dict[tuple[int, int, str, str], TileConfig] = {}


def tile_bucket(num_tokens: int) -> str:
    """The GPU tile-config bucket of a token count (the CPU dispatch has its own, `cpu_dispatch.token_bucket`)."""
    for limit in (16, 128, 1024):
        if num_tokens <= limit:
            return f"le{limit}"
    return "gt1024"


def get_tile_config(num_experts: int, intermediate: int, device_name: str, num_tokens: int) -> TileConfig:
    bucket = tile_bucket(num_tokens)
    return _TUNED_CONFIGS.get((num_experts, intermediate, device_name, bucket), _DEFAULT_CONFIGS[bucket])
