"""What the vLLM suite's conftest and tests share: the models, the prompts, and running vllm_rollouts.py."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
# Prompts of different lengths (a padded batch) and what vLLM generates after them; the longest fills a KV block
# (32 tokens), which vLLM's prefix cache then holds for the later passes.
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15], [21, 22, 23], list(range(40, 80))]
MAX_TOKENS = 16
PROMPT_START = 2  # SamplingParams(routed_experts_prompt_start=...) in the "offset" pass
ALL_PASSES = ("greedy", "offset", "sampled")  # vllm_rollouts.py says what each is

# name -> (model_type, config overrides). The first three are the suite's usual checkpoints (every layer MoE);
# the others have a dense layer, which vLLM's routed_experts still has an entry for (all zeros).
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "mixtral": ("mixtral", {}),
    "qwen2_moe-dense0": ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [0]}),
    "qwen3_moe-dense1": ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
}
SERVED = "qwen3_moe-dense1"  # the model the OpenAI-server test starts a server for


def run_rollouts(
    checkpoint: Path, out: Path, passes: tuple[str, ...] = ALL_PASSES, enforce_eager: bool = True
) -> dict:
    """vllm_rollouts.py's result for `checkpoint` (a subprocess: vLLM's engine stays out of this process).
    vLLM's compile cache goes beside `out`, not to ~/.cache/vllm."""
    spec = {
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "prompt_start": PROMPT_START,
        "passes": list(passes),
        "enforce_eager": enforce_eager,
    }
    command = [sys.executable, str(HERE / "vllm_rollouts.py"), str(checkpoint), str(out), json.dumps(spec)]
    env = {**os.environ, "VLLM_CACHE_ROOT": str(out.parent / "vllm_cache")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, f"vLLM failed on {checkpoint}:\n{result.stderr[-6000:]}"
    return pickle.loads(out.read_bytes())


@dataclass
class VllmModel:
    name: str
    model_type: str
    path: Path
    rollouts: dict = field(repr=False)
