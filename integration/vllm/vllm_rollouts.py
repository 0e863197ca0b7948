"""Rollouts of one checkpoint in vLLM (offline `LLM`, eager mode, routed experts returned), pickled.

    python vllm_rollouts.py CHECKPOINT OUT.pkl SPEC
    SPEC: '{"prompts": [[1, 2, 3]], "max_tokens": 6, "prompt_start": 2, "passes": ["greedy", "offset", "sampled"]}'

(the spec may add "enforce_eager": false, for vLLM's compiled mode). The passes run in this order, in one engine:
- "greedy" -> "outputs": the prompts, greedy;
- "offset" -> "offset_outputs": the same again, with SamplingParams(routed_experts_prompt_start=prompt_start);
- "sampled" -> "sampled_outputs": two samples of each prompt (n=2, temperature 1, seed 0), as GRPO draws them,
  flattened prompt by prompt.
The later passes find the prompts' full KV blocks (32 tokens) in vLLM's prefix cache.

The tests run it in a subprocess of their own: vLLM's engine (its process-wide settings, distributed state and
thread binding) stays out of the process that loads the same checkpoint in transformers under layerswap's bundles.
OUT.pkl holds plain types and numpy arrays: {"vllm": version, "outputs": [...], ...}, each output
{"prompt_token_ids", "token_ids", "logprobs" (of each chosen token), "routed_experts" (vLLM's array),
"num_cached_tokens" (prompt tokens vLLM found in its prefix cache)}.
"""

from __future__ import annotations

import json
import os
import pickle
import sys

MAX_MODEL_LEN = 64
# vLLM's CPU default is 128; its prefix cache holds full blocks only, so the tests' prompts (up to 40 tokens) would
# never be found in it.
BLOCK_SIZE = 32


def _plain(request_output, completion) -> dict:
    return {
        "prompt_token_ids": list(request_output.prompt_token_ids),
        "token_ids": list(completion.token_ids),
        "logprobs": [
            step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
        ],
        "routed_experts": completion.routed_experts,
        "num_cached_tokens": request_output.num_cached_tokens,
    }


def main(checkpoint: str, out: str, spec: dict) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    # enforce_eager: vLLM 0.30.0's compiled mode returns all-zero routed_experts (layerswap rejects them); the
    # spec turns it off only to show that.
    llm = LLM(
        model=checkpoint,
        dtype="float32",
        enforce_eager=spec.get("enforce_eager", True),
        enable_return_routed_experts=True,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        seed=0,
    )
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]

    def generate(temperature: float = 0.0, **options) -> list[dict]:
        params = SamplingParams(temperature=temperature, max_tokens=spec["max_tokens"], logprobs=0, **options)
        return [_plain(r, c) for r in llm.generate(prompts, params, use_tqdm=False) for c in r.outputs]

    passes = {
        "greedy": ("outputs", lambda: generate()),
        "offset": ("offset_outputs", lambda: generate(routed_experts_prompt_start=spec["prompt_start"])),
        "sampled": ("sampled_outputs", lambda: generate(temperature=1.0, n=2, seed=0)),
    }
    result = {"vllm": vllm.__version__}
    for name in spec["passes"]:
        key, run = passes[name]
        result[key] = run()
    with open(out, "wb") as file:
        pickle.dump(result, file)


if __name__ == "__main__":
    # The engine in this process (no engine-core subprocess), 1 GiB of KV cache, and no thread pinning: vLLM's
    # CPU backend otherwise binds its OpenMP threads to cores of its own choosing, not those this process may use.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
