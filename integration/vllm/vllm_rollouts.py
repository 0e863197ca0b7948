"""Greedy rollouts of one checkpoint in vLLM (offline `LLM`, eager mode, routed experts returned), pickled.

    python vllm_rollouts.py CHECKPOINT OUT.pkl '{"prompts": [[1, 2, 3]], "max_tokens": 6, "prompt_start": 2}'

(the spec may add "enforce_eager": false, for vLLM's compiled mode).

The tests run it in a subprocess of their own: vLLM's engine (its process-wide settings, distributed state and
thread binding) stays out of the process that loads the same checkpoint in transformers under layerswap's bundles.
OUT.pkl holds plain types and numpy arrays: {"vllm": version, "outputs": [...], "offset_outputs": [...]}, each
output {"prompt_token_ids", "token_ids", "logprobs" (of each chosen token), "routed_experts" (vLLM's array)};
"offset_outputs" (the same prompts again, with SamplingParams(routed_experts_prompt_start=prompt_start)) only when
the spec has a prompt_start.
"""

from __future__ import annotations

import json
import os
import pickle
import sys

MAX_MODEL_LEN = 64


def _plain(request_output) -> dict:
    completion = request_output.outputs[0]
    return {
        "prompt_token_ids": list(request_output.prompt_token_ids),
        "token_ids": list(completion.token_ids),
        "logprobs": [
            step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
        ],
        "routed_experts": completion.routed_experts,
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
        seed=0,
    )
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]

    def generate(**options) -> list[dict]:
        params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=0, **options)
        return [_plain(output) for output in llm.generate(prompts, params, use_tqdm=False)]

    result = {"vllm": vllm.__version__, "outputs": generate()}
    if spec.get("prompt_start") is not None:
        result["offset_outputs"] = generate(routed_experts_prompt_start=spec["prompt_start"])
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
