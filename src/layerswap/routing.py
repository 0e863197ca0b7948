"""Record and replay MoE expert choices, and read vLLM's routed experts.

Token order. A router sees a forward's tokens flattened row-major from [batch, seq], padding tokens included:
row `b * seq_len + s` is token `s` of sequence `b`. Over several forwards (e.g. `generate` with a KV cache:
first the prompt, then one token per sequence per step) the rows of each forward follow the rows of the one
before. `record_routing` stores, and `replay_routing` consumes, per-layer rows in exactly that order.

    with layerswap.use_bundle("qwen3_moe-replay"):
        model = AutoModelForCausalLM.from_pretrained(...)
    with layerswap.record_routing(model) as recorded:
        model.generate(input_ids, ...)                # or a plain forward
    with layerswap.replay_routing(model, recorded):  # same experts, weights from the live router
        model.generate(input_ids, ...)

    # Training on vLLM rollouts (vLLM run with enable_return_routed_experts=True and enforce_eager=True):
    # one forward over prompt + completion, padded. vLLM's arrays have an entry per decoder layer; dense
    # layers' entries are ignored.
    routing = layerswap.routing_from_vllm([o.outputs[0] for o in request_outputs], attention_mask=mask)
    with layerswap.replay_routing(model, routing):
        model(input_ids, attention_mask=mask, labels=labels).loss.backward()

Every replayed row must name top_k distinct experts: vLLM's compiled mode (0.30.0) returned all-zero rows,
which are rejected rather than trained on. A row of -1 in every entry routes that token live (the prompt rows
before vLLM's routed_experts_prompt_start: `routing_from_vllm(..., prompt_start=N)`).
"""

from __future__ import annotations

import base64
import binascii
import io
import numbers
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .errors import BundleError, RoutingMismatchError
from .families import FAMILIES
from .swaps.replay import ReplayableRouter

__all__ = ["RecordedRouting", "record_routing", "replay_routing", "routing_from_vllm"]

# A routing row of all LIVE (-1) routes that token by the router's own top-k instead (routing_from_vllm's
# prompt_start: the prompt rows vLLM did not return).
LIVE = -1

_VLLM_ZERO_FILL = (
    "No top-k router picks an expert twice, so this routing was not produced by one: most likely it is "
    "zero-filled. vLLM 0.30.0 in its default compiled mode returned all-zero routed_experts for every request; "
    "run vLLM with enforce_eager=True and generate the rollouts again."
)


# --- finding the routers ----------------------------------------------------------------------------------


def moe_routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every MoE router in `model`, in layer order; stock or replayable."""
    stock_names = {family.router for family in FAMILIES if family.router}
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, ReplayableRouter) or type(module).__name__ in stock_names
    ]


def _routers_or_raise(model: nn.Module, action: str) -> list[tuple[str, nn.Module]]:
    routers = moe_routers(model)
    if not routers:
        raise BundleError(
            f"{action}: {type(model).__name__} has no MoE router layerswap knows "
            f"(see `layerswap list` for the '-replay' bundles and their model types)."
        )
    return routers


# --- recording --------------------------------------------------------------------------------------------


@dataclass
class RecordedRouting:
    """Expert choices recorded by `record_routing`.

    selected_experts: one LongTensor [num_tokens, top_k] per MoE layer, in layer order. Over several forwards
        inside one `record_routing` block, each layer's rows are the forwards' rows concatenated in call order
        (for `generate`: the prompt tokens, then one row per sequence per decoding step; the last generated token
        is never fed back, so it has no row). That is the order `replay_routing` consumes them in.
    tokens_per_forward: how many rows each forward added, to split `selected_experts` per forward.
    layer_names: the router module of each layer.
    """

    layer_names: list[str]
    _calls: list[list[torch.Tensor]] = field(repr=False)

    @property
    def selected_experts(self) -> list[torch.Tensor]:
        return [torch.cat(calls) if calls else torch.empty(0, 0, dtype=torch.long) for calls in self._calls]

    @property
    def tokens_per_forward(self) -> list[int]:
        return [chunk.shape[0] for chunk in self._calls[0]] if self._calls else []


@contextmanager
def record_routing(model: nn.Module) -> Iterator[RecordedRouting]:
    """Record, for every MoE layer, the experts its router picks in the forwards run inside the block.

    Works with stock routers and with the '-replay' bundles' routers (under `replay_routing` it records the
    replayed choices). The indices stay on the device they were computed on.
    """
    routers = _routers_or_raise(model, "record_routing")
    recorded = RecordedRouting([name for name, _ in routers], [[] for _ in routers])

    def recorder(calls: list[torch.Tensor]) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            calls.append(output[2].detach())

        return hook

    handles = [
        router.register_forward_hook(recorder(calls))
        for (_, router), calls in zip(routers, recorded._calls, strict=True)
    ]
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


# --- replaying --------------------------------------------------------------------------------------------


@dataclass
class _LayerReplay:
    """One layer's recorded choices, handed to its router forward by forward, as `schedule` says."""

    layer: int
    name: str
    selected: torch.Tensor  # [total_tokens, top_k], int64; rows of LIVE route live
    schedule: tuple[int, ...]  # tokens per forward, summing to total_tokens
    routes_live: bool = False  # some rows are LIVE: the router must also compute its own choice
    unmasked_vllm_sequences: int = 0  # routing_from_vllm's sequences, concatenated without an attention_mask
    step: int = 0
    cursor: int = 0

    def take(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        expected = self.schedule[self.step]
        # Checked on every forward, not at the end of the block: a batch that does not match the recording
        # must fail before anything is trained on misaligned routing.
        if num_tokens != expected:
            raise RoutingMismatchError(self._mismatch(num_tokens, expected))
        rows = self.selected[self.cursor : self.cursor + num_tokens]
        self.step, self.cursor = self.step + 1, self.cursor + num_tokens
        if self.step == len(self.schedule):
            # Start over: repeated passes (epochs over one batch, gradient checkpointing's recompute) replay
            # the same routing again.
            self.step = self.cursor = 0
        return rows.to(device, non_blocking=True)

    def _mismatch(self, num_tokens: int, expected: int) -> str:
        where = f"forward {self.step + 1} of {len(self.schedule)}, tokens_per_forward {list(self.schedule)}"
        message = (
            f"replay_routing: MoE layer {self.layer} ({self.name}) routes {num_tokens} tokens in this forward, "
            f"but the recorded routing has {expected} tokens for it ({where}). Replay exactly the inputs that "
            "were recorded (same batch, same padding), in the same order."
        )
        sequences = self.unmasked_vllm_sequences
        if sequences > 1 and num_tokens == expected + sequences:
            message += (
                f" That is each of the {sequences} vLLM sequences is one row short of its prompt + output "
                "tokens: vLLM never feeds back the last generated token, so it has no routing. Pass "
                "attention_mask= to routing_from_vllm (torch.ones(batch, seq) for a batch without padding): it "
                "fills that row in."
            )
        elif num_tokens == expected + 1:
            message += (
                " One token short is vLLM's convention (the last generated token has no routing): pass "
                "attention_mask to routing_from_vllm to fill it in."
            )
        return message


@contextmanager
def replay_routing(
    model: nn.Module,
    selected_experts: Sequence[torch.Tensor] | RecordedRouting,
    tokens_per_forward: Sequence[int] | None = None,
) -> Iterator[None]:
    """Route every MoE layer of `model` by `selected_experts` instead of its top-k; weights are recomputed from
    the current router parameters, so gradients flow.

    selected_experts: integer [num_tokens, top_k] tensors, either one per MoE layer in layer order (what
        `record_routing` gives), or one per decoder layer (`config.num_hidden_layers`, what vLLM returns and
        `routing_from_vllm` keeps): then each router takes the entry of its decoder layer (`model.layers.N...`)
        and the entries of dense layers (deepseek_v3's first_k_dense_replace, qwen2_moe's mlp_only_layers /
        decoder_sparse_step) are ignored, whatever they hold. Every row must name top_k distinct experts in
        [0, num_experts): anything else (vLLM's zero-filled rows, say) raises RoutingMismatchError before any
        forward. A row of -1 in every entry routes that token by the router's own top-k.

    tokens_per_forward: how the recorded rows split over the forwards inside the block, in order (e.g.
        `generate` with a KV cache: [batch * prompt_len, batch, batch, ...]). Defaults to the recording's own
        (`RecordedRouting.tokens_per_forward`), or else to one forward over all rows. Each forward must route
        exactly its share, or RoutingMismatchError is raised right there; after the last share the schedule
        starts over, so the same batch can be replayed again. Leaving the block half-way through the schedule
        also raises.

    `model` must have been loaded with its '<model_type>-replay' bundle enabled.
    """
    unmasked_vllm_sequences = getattr(selected_experts, "unmasked_vllm_sequences", 0)
    if isinstance(selected_experts, RecordedRouting):
        if tokens_per_forward is None:
            tokens_per_forward = selected_experts.tokens_per_forward
        selected_experts = selected_experts.selected_experts
    routers = _routers_or_raise(model, "replay_routing")
    for name, router in routers:
        if not isinstance(router, ReplayableRouter):
            model_type = getattr(getattr(model, "config", None), "model_type", "<model_type>")
            raise BundleError(
                f"replay_routing needs replayable routers, but {name} is the stock {type(router).__name__}. "
                f"Load the model with the '{model_type}-replay' bundle enabled (layerswap.enable_bundle or "
                "use_bundle, before from_pretrained / from_config)."
            )
    per_router = _routing_per_router(model, routers, selected_experts)
    replays = _layer_replays(routers, per_router, tokens_per_forward, unmasked_vllm_sequences)
    busy = [name for name, router in routers if router._layerswap_replay is not None]
    if busy:
        raise BundleError(f"replay_routing: {busy[0]} is already replaying; replay blocks do not nest.")
    for (_, router), replay in zip(routers, replays, strict=True):
        router._layerswap_replay = replay
    try:
        yield
    finally:
        for _, router in routers:
            del router._layerswap_replay
    # Only reached when the block succeeded: an error inside it is never masked by this one.
    unfinished = [r for r in replays if r.step]
    if unfinished:
        r = unfinished[0]
        raise RoutingMismatchError(
            f"replay_routing: MoE layer {r.layer} ({r.name}) replayed {r.step} of the {len(r.schedule)} "
            f"recorded forwards (tokens_per_forward {list(r.schedule)}). Run every recorded forward inside "
            "the block (e.g. generate stopped early: pass min_new_tokens), or pass the tokens_per_forward "
            "you do run, with the routing sliced to match."
        )


def _decoder_layer_index(name: str) -> int | None:
    """N of a router named like `model.layers.N.mlp.gate` (the decoder layer it lives in), else None."""
    match = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def _routing_per_router(
    model: nn.Module, routers: list[tuple[str, nn.Module]], selected_experts: Sequence[Any]
) -> list[Any]:
    """One entry of `selected_experts` per router: as given (one per MoE layer), or picked by decoder layer
    index from one entry per decoder layer (vLLM's layout, dense layers included)."""
    given = len(selected_experts)
    if given == len(routers):
        return list(selected_experts)
    decoder_layers = [_decoder_layer_index(name) for name, _ in routers]
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_decoder_layers = getattr(text_config, "num_hidden_layers", None)
    by_index = (
        isinstance(num_decoder_layers, int)
        and None not in decoder_layers
        and len(set(decoder_layers)) == len(decoder_layers)
        and max(decoder_layers) < num_decoder_layers  # type: ignore[type-var]
    )
    if by_index and given == num_decoder_layers:
        return [selected_experts[index] for index in decoder_layers]  # type: ignore[index]
    alternative = ""
    if by_index and num_decoder_layers != len(routers):
        alternative = (
            f", or {num_decoder_layers}, one per decoder layer as vLLM's routed_experts has: MoE at decoder "
            f"layers {decoder_layers}, the other layers' entries ignored"
        )
    raise RoutingMismatchError(
        f"replay_routing: the routing has {given} layers, but the model has {len(routers)} MoE layers "
        f"(expected {len(routers)} tensors, one per router: {routers[0][0]} ... {routers[-1][0]}{alternative})."
    )


def _layer_replays(
    routers: list[tuple[str, nn.Module]],
    selected_experts: Sequence[Any],
    tokens_per_forward: Any,
    unmasked_vllm_sequences: int = 0,
) -> list[_LayerReplay]:
    checked = [
        _checked_layer(f"replay_routing: MoE layer {layer} ({name})", router, selected)
        for layer, ((name, router), selected) in enumerate(zip(routers, selected_experts, strict=True))
    ]
    tensors = [tensor for tensor, _ in checked]
    total = tensors[0].shape[0]
    for layer, ((name, _), tensor) in enumerate(zip(routers, tensors, strict=True)):
        if tensor.shape[0] != total:
            raise RoutingMismatchError(
                f"replay_routing: MoE layer {layer} ({name}): the routing has {tensor.shape[0]} tokens, but "
                f"layer 0 has {total}; every MoE layer routes the same tokens (expected {total})."
            )
    schedule = tuple(int(n) for n in tokens_per_forward) if tokens_per_forward is not None else (total,)
    if sum(schedule) != total or not all(n > 0 for n in schedule):
        raise RoutingMismatchError(
            f"replay_routing: tokens_per_forward {list(schedule)} sums to {sum(schedule)}, but the routing has "
            f"{total} tokens per layer (expected positive counts summing to {total})."
        )
    return [
        _LayerReplay(layer, name, tensor, schedule, routes_live, unmasked_vllm_sequences)
        for layer, ((name, _), (tensor, routes_live)) in enumerate(zip(routers, checked, strict=True))
    ]


def _repeated_rows(selected: torch.Tensor) -> torch.Tensor:
    """Which rows (over the last dim) name an expert more than once; vectorised, any leading shape."""
    if selected.shape[-1] < 2:
        return torch.zeros(selected.shape[:-1], dtype=torch.bool, device=selected.device)
    ordered = selected.sort(dim=-1).values
    return (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)


def _checked_layer(where: str, router: nn.Module, selected: Any) -> tuple[torch.Tensor, bool]:
    """`selected` as int64 [num_tokens, top_k], and whether it has LIVE rows; raises on a routing no top-k router
    produces (every check is vectorised: a long rollout has millions of rows)."""
    selected = torch.as_tensor(selected)
    if selected.dim() != 2 or selected.dtype.is_floating_point or selected.dtype == torch.bool:
        raise RoutingMismatchError(
            f"{where}: expected an integer tensor [num_tokens, top_k], got {selected.dtype} of shape "
            f"{tuple(selected.shape)}."
        )
    if selected.shape[1] != router.top_k:
        raise RoutingMismatchError(
            f"{where}: the routing has top_k {selected.shape[1]}, but the router picks top_k {router.top_k} "
            f"experts per token (expected shape [num_tokens, {router.top_k}])."
        )
    if selected.shape[0] == 0:
        raise RoutingMismatchError(f"{where}: the routing has no tokens.")
    selected = selected.long()
    # longcat_flash's router also chooses its identity experts, which n_routed_experts counts and num_experts not.
    num_experts = getattr(router, "n_routed_experts", router.num_experts)
    low, high = (int(v) for v in torch.aminmax(selected))
    if low >= 0 and high < num_experts:  # the usual case: one pass, no LIVE rows
        live, routes_live = None, False
    else:
        live = (selected == LIVE).all(dim=1)
        routes_live = bool(live.any())
        chosen = selected[~live] if routes_live else selected
        low, high = (int(v) for v in torch.aminmax(chosen)) if chosen.numel() else (0, 0)
    if live is not None and (low < 0 or high >= num_experts):
        out_of_range = ((selected < 0) | (selected >= num_experts)).any(dim=1) & ~live
        row = int(out_of_range.nonzero()[0, 0])
        raise RoutingMismatchError(
            f"{where}: expert ids must lie in [0, {num_experts}), found {low}..{high}; token row {row} has "
            f"{selected[row].tolist()} ({int(out_of_range.sum())} of {selected.shape[0]} rows are out of range). "
            "Only a row of -1 in every entry is allowed: it routes that token live."
        )
    repeated = _repeated_rows(selected)
    if live is not None:
        repeated &= ~live
    if repeated.any():
        row = int(repeated.nonzero()[0, 0])
        raise RoutingMismatchError(
            f"{where}: token row {row} picks experts {selected[row].tolist()}, an expert twice "
            f"({int(repeated.sum())} of {selected.shape[0]} rows repeat an expert). {_VLLM_ZERO_FILL}"
        )
    return selected, routes_live


# --- vLLM -------------------------------------------------------------------------------------------------


class _VllmRouting(list):
    """routing_from_vllm's result: a plain list of per-layer tensors that also remembers how many vLLM sequences
    it concatenated without an attention_mask, so that a replay one row short per sequence can say why."""

    def __init__(self, tensors: list[torch.Tensor], unmasked_vllm_sequences: int) -> None:
        super().__init__(tensors)
        self.unmasked_vllm_sequences = unmasked_vllm_sequences


def routing_from_vllm(
    routed_experts: Any | Sequence[Any],
    attention_mask: torch.Tensor | None = None,
    *,
    prompt_start: int | Sequence[int] = 0,
) -> list[torch.Tensor]:
    """vLLM's routed experts as `replay_routing` input: one LongTensor [num_tokens, top_k] per layer of vLLM's
    array (one per decoder layer: `replay_routing` picks the MoE layers' entries).

    What vLLM returns (0.30, 0.32), with the engine started with `enable_return_routed_experts=True`:
    - offline `LLM.generate`: `RequestOutput.outputs[i].routed_experts` of each `CompletionOutput`, an integer
      numpy array [num_prompt_tokens + num_output_tokens - 1, num_hidden_layers, top_k]: one row per token but
      the last generated one (never fed back, so never routed), one entry per DECODER layer, dense layers
      zero-filled. Pass the CompletionOutput, its array, or a RequestOutput with a single completion (with
      several, pass them one by one: each is its own sequence).
    - the OpenAI server: each choice's `routed_experts`, the same array as a base64-encoded `.npy` string
      (uint8 / uint16). Pass the string, or the choice (object or JSON dict); decoding needs numpy.
    - `SamplingParams(routed_experts_prompt_start=N)`: rows start at prompt token N. Pass `prompt_start=N`
      (or one per sequence): the first N rows of each sequence become rows of -1, which `replay_routing` routes
      by the live router; only the rows vLLM returned are replayed.

    Layouts:
    - One array: its rows in order, for a forward over that one sequence.
    - A list of arrays (one per sequence) without `attention_mask`: concatenated, for a batch without padding
      (rows are flattened row-major from [batch, seq]). vLLM's arrays are one row short of each sequence, so
      this replays only inputs without each sequence's last token; pass a mask to fill that row in instead.
    - A list with `attention_mask` [batch, seq]: sequence b's rows go to the positions where row b of the mask
      is 1, in order (left or right padding alike), at flat row `b * seq + s`. Padding positions get experts
      0..top_k-1: the attention mask hides padding tokens from every real token, and each token's MoE output
      depends only on itself, so this choice changes no real token's output (beyond float round-off: the
      experts batch each expert's tokens together, and padding changes those batch sizes).
      A sequence may be one row short of its real tokens: vLLM never feeds back the last generated token, so
      it has no routing; its row is filled the same way (it changes only the logits after the sequence's end).

    Checks: a row that names an expert twice or a negative id raises RoutingMismatchError (vLLM 0.30.0 in its
    default compiled mode returned all-zero rows: run it with enforce_eager=True). A layer that is zero in every
    row is kept as is (a dense layer's zero fill; replay_routing ignores dense layers' entries), unless every
    layer is: then the whole array is zero-filled and rejected. A RequestOutput's token counts are checked
    against its rows.
    """
    items = list(routed_experts) if _list_depth(routed_experts) not in (0, 3) else [routed_experts]
    if not items:
        raise RoutingMismatchError("routing_from_vllm: no sequences given.")
    starts = _prompt_starts(prompt_start, len(items))
    tensors = [
        _vllm_sequence(item, index, start)
        for index, (item, start) in enumerate(zip(items, starts, strict=True))
    ]
    num_layers, top_k = tensors[0].shape[1:]
    for index, tensor in enumerate(tensors):
        if tensor.shape[1:] != (num_layers, top_k):
            raise RoutingMismatchError(
                f"routing_from_vllm: sequence {index} has {tensor.shape[1]} layers and top_k {tensor.shape[2]}, "
                f"sequence 0 has {num_layers} layers and top_k {top_k}; all must match."
            )
    _check_vllm_expert_ids(tensors)
    if attention_mask is None:
        live = [torch.full((start, num_layers, top_k), LIVE, dtype=torch.long) for start in starts]
        flat = torch.cat([part for pair in zip(live, tensors, strict=True) for part in pair])
        unmasked = len(tensors)
    else:
        flat = _scatter_to_padded(tensors, torch.as_tensor(attention_mask), top_k, starts)
        unmasked = 0
    return _VllmRouting([flat[:, layer].contiguous() for layer in range(num_layers)], unmasked)


def _list_depth(value: Any) -> int:
    """How deep Python lists nest: 0 for an array, 1 for a list of arrays, 3 for one sequence as nested lists,
    4 for several."""
    depth = 0
    while isinstance(value, (list, tuple)) and value:
        depth, value = depth + 1, value[0]
    return depth


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _prompt_starts(prompt_start: Any, num_sequences: int) -> list[int]:
    if isinstance(prompt_start, torch.Tensor):
        prompt_start = prompt_start.tolist()
    if _is_int(prompt_start):
        starts = [int(prompt_start)] * num_sequences
    elif (
        isinstance(prompt_start, Sequence)
        and not isinstance(prompt_start, (str, bytes))
        and len(prompt_start) == num_sequences
        and all(_is_int(start) for start in prompt_start)
    ):
        starts = [int(start) for start in prompt_start]
    else:
        starts = [-1]
    if min(starts) < 0:
        raise RoutingMismatchError(
            f"routing_from_vllm: prompt_start must be a non-negative int (the request's "
            f"SamplingParams.routed_experts_prompt_start), or a list of one per sequence ({num_sequences}); got "
            f"{prompt_start!r}."
        )
    return starts


def _vllm_sequence(item: Any, index: int, start: int) -> torch.Tensor:
    """One sequence's routed experts as int64 [rows, num_layers, top_k], from whatever vLLM object holds them."""
    num_prompt_tokens = num_output_tokens = None
    outputs = getattr(item, "outputs", None)
    if isinstance(outputs, (list, tuple)):  # a RequestOutput
        if len(outputs) != 1:
            raise BundleError(
                f"routing_from_vllm: sequence {index} is a RequestOutput with {len(outputs)} completions; its "
                "routing is per completion. Pass the CompletionOutputs instead: request_output.outputs[0], or "
                "[c for r in request_outputs for c in r.outputs] to make every sample a sequence of the batch."
            )
        prompt_token_ids = getattr(item, "prompt_token_ids", None)
        num_prompt_tokens = len(prompt_token_ids) if prompt_token_ids is not None else None
        item = outputs[0]
        token_ids = getattr(item, "token_ids", None)
        num_output_tokens = len(token_ids) if token_ids is not None else None
    if isinstance(item, Mapping):  # a JSON choice of vLLM's OpenAI server
        item = item.get("routed_experts")
    array = getattr(item, "routed_experts", item)  # a CompletionOutput, or a server choice object
    if array is None:
        raise BundleError(
            f"routing_from_vllm: sequence {index} has no routed_experts; start vLLM with "
            "enable_return_routed_experts=True."
        )
    if isinstance(array, (str, bytes)):
        array = _decode_npy(array, index)
    try:
        tensor = torch.as_tensor(array)
    except (TypeError, RuntimeError, ValueError) as error:
        raise RoutingMismatchError(
            f"routing_from_vllm: sequence {index}: expected vLLM's routed_experts (an integer array "
            f"[seq_len, num_layers, top_k], its base64 .npy string, or the CompletionOutput holding it), got "
            f"{type(array).__name__} ({error})."
        ) from error
    if tensor.dim() != 3 or tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        raise RoutingMismatchError(
            f"routing_from_vllm: sequence {index}: expected integers [seq_len, num_layers, top_k], got "
            f"{tensor.dtype} of shape {tuple(tensor.shape)}."
        )
    rows = tensor.shape[0]
    if num_prompt_tokens is not None and start >= num_prompt_tokens:
        raise RoutingMismatchError(
            f"routing_from_vllm: sequence {index}: prompt_start {start} must be smaller than its prompt, but the "
            f"prompt has {num_prompt_tokens} tokens (as vLLM requires of routed_experts_prompt_start)."
        )
    if num_prompt_tokens is not None and num_output_tokens is not None:
        expected = num_prompt_tokens + num_output_tokens - start - 1
        if rows not in (expected, expected + 1):
            offset = f" from prompt_start {start}" if start else ""
            raise RoutingMismatchError(
                f"routing_from_vllm: sequence {index} has {rows} routed tokens, but its request has "
                f"{num_prompt_tokens} prompt + {num_output_tokens} output tokens: expected {expected} (every token "
                f"but the last generated one{offset}). If the request set "
                "SamplingParams(routed_experts_prompt_start=N), pass prompt_start=N."
            )
    return tensor.long()


def _decode_npy(text: str | bytes, index: int) -> Any:
    """vLLM's OpenAI server format: `np.save` bytes, base64-encoded."""
    try:
        import numpy as np
    except ImportError as error:  # transformers needs numpy, so this is unlikely; torch does not
        raise BundleError(
            "routing_from_vllm: decoding vLLM's OpenAI-server routed_experts (base64 .npy) needs numpy: "
            "pip install numpy."
        ) from error
    try:
        return np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as error:
        raise RoutingMismatchError(
            f"routing_from_vllm: sequence {index}: routed_experts is a string, but not a base64-encoded .npy "
            f"integer array as vLLM's OpenAI server sends ({error})."
        ) from error


def _check_vllm_expert_ids(tensors: list[torch.Tensor]) -> None:
    """Reject rows no top-k router produces (vectorised over every row of every sequence and layer)."""
    flat = torch.cat(tensors)  # [rows, num_layers, top_k]
    if flat.numel() == 0:
        return
    top_k = flat.shape[2]
    has_negatives = int(flat.min()) < 0
    ordered = flat.sort(dim=-1).values
    # [num_layers]: zero in every row is a dense layer's zero fill (or, in every layer, a zero-filled array)
    zero_layers = (
        ~(ordered != 0).any(dim=2).any(dim=0) if has_negatives else ~(ordered[..., -1] != 0).any(dim=0)
    )
    if top_k > 1 and bool(zero_layers.all()):
        raise RoutingMismatchError(
            f"routing_from_vllm: the routed experts are all zeros in every layer ({flat.shape[0]} rows of "
            f"{len(tensors)} sequence(s)). {_VLLM_ZERO_FILL}"
        )
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1) & ~zero_layers
    negative = ordered[..., 0] < 0 if has_negatives else torch.zeros_like(repeated)
    bad = negative | repeated
    if not bool(bad.any()):
        return
    row, layer = (int(i) for i in bad.nonzero()[0])
    ends = torch.tensor([t.shape[0] for t in tensors]).cumsum(0)
    sequence = int(torch.searchsorted(ends, row, right=True))
    token_row = row - (int(ends[sequence - 1]) if sequence else 0)
    what = "a negative expert id" if negative[row, layer] else "an expert twice"
    raise RoutingMismatchError(
        f"routing_from_vllm: sequence {sequence}, token row {token_row}, layer {layer}: experts "
        f"{flat[row, layer].tolist()} name {what} ({int(bad.sum())} (row, layer) entries are invalid). "
        f"{_VLLM_ZERO_FILL}"
    )


def _scatter_to_padded(
    tensors: list[torch.Tensor], mask: torch.Tensor, top_k: int, starts: list[int]
) -> torch.Tensor:
    if mask.dim() != 2 or mask.shape[0] != len(tensors):
        raise RoutingMismatchError(
            f"routing_from_vllm: attention_mask must be [batch, seq] with one row per sequence; got shape "
            f"{tuple(mask.shape)} for {len(tensors)} sequences (expected ({len(tensors)}, seq))."
        )
    batch, seq_len = mask.shape
    num_layers = tensors[0].shape[1]
    filler = torch.arange(top_k).expand(batch * seq_len, num_layers, top_k)
    flat = filler.clone()
    for row, (tensor, start) in enumerate(zip(tensors, starts, strict=True)):
        positions = mask[row].nonzero().squeeze(1)
        real, rows = positions.numel(), tensor.shape[0]
        if start + rows not in (real, real - 1):
            offset = f" from prompt_start {start}" if start else ""
            raise RoutingMismatchError(
                f"routing_from_vllm: sequence {row} has {rows} routed tokens{offset}, but row {row} of "
                f"attention_mask has {real} real tokens (expected {real - start}, or {real - start - 1} when vLLM "
                "left out the last generated token)."
            )
        flat[row * seq_len + positions[:start]] = LIVE
        flat[row * seq_len + positions[start : start + rows]] = tensor
    return flat
