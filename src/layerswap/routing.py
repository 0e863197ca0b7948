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

    # Training on vLLM rollouts: one forward over prompt + completion, padded.
    routing = layerswap.routing_from_vllm([o.outputs[0] for o in request_outputs], attention_mask=mask)
    with layerswap.replay_routing(model, routing):
        model(input_ids, attention_mask=mask, labels=labels).loss.backward()
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.utils import output_capturing
from transformers.utils.output_capturing import OutputRecorder

from ._bundle import Bundle, BundleOptions, Installer, Patch
from ._compat import TRANSFORMERS_VERSION
from ._errors import BundleError, RoutingMismatchError, UnsupportedTransformersError
from .adapters.routers import SCORERS, ReplayableRouter, replayable_router_adapter

if TYPE_CHECKING:
    from .catalog import Family

__all__ = ["RecordedRouting", "record_routing", "replay_routing", "routing_from_vllm"]

# Capture key: `model.model(..., output_selected_experts=True).selected_experts`, one [T, K] per MoE layer.
SELECTED_EXPERTS = "selected_experts"


# --- finding the routers ----------------------------------------------------------------------------------


def moe_routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every MoE router in `model`, in layer order; stock or replayable."""
    from .catalog import FAMILIES

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
    selected: torch.Tensor  # [total_tokens, top_k], int64
    schedule: tuple[int, ...]  # tokens per forward, summing to total_tokens
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
        if num_tokens == expected + 1:
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
    """Route every MoE layer of `model` by `selected_experts` (one [num_tokens, top_k] per MoE layer, in layer
    order) instead of its top-k; weights are recomputed from the current router parameters, so gradients flow.

    tokens_per_forward: how the recorded rows split over the forwards inside the block, in order (e.g.
        `generate` with a KV cache: [batch * prompt_len, batch, batch, ...]). Defaults to the recording's own
        (`RecordedRouting.tokens_per_forward`), or else to one forward over all rows. Each forward must route
        exactly its share, or RoutingMismatchError is raised right there; after the last share the schedule
        starts over, so the same batch can be replayed again. Leaving the block half-way through the schedule
        also raises.

    `model` must have been loaded with its '<model_type>-replay' bundle enabled.
    """
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
    replays = _layer_replays(routers, selected_experts, tokens_per_forward)
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


def _layer_replays(
    routers: list[tuple[str, nn.Module]], selected_experts: Sequence[Any], tokens_per_forward: Any
) -> list[_LayerReplay]:
    if len(selected_experts) != len(routers):
        raise RoutingMismatchError(
            f"replay_routing: the routing has {len(selected_experts)} layers, but the model has "
            f"{len(routers)} MoE layers (expected {len(routers)} tensors, one per router: "
            f"{routers[0][0]} ... {routers[-1][0]})."
        )
    tensors = [
        _checked_layer(f"replay_routing: MoE layer {layer} ({name})", router, selected)
        for layer, ((name, router), selected) in enumerate(zip(routers, selected_experts, strict=True))
    ]
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
        _LayerReplay(layer, name, tensor, schedule)
        for layer, ((name, _), tensor) in enumerate(zip(routers, tensors, strict=True))
    ]


def _checked_layer(where: str, router: nn.Module, selected: Any) -> torch.Tensor:
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
    low, high = int(selected.min()), int(selected.max())
    if low < 0 or high >= router.num_experts:
        raise RoutingMismatchError(
            f"{where}: expert ids must lie in [0, {router.num_experts}), found {low}..{high}."
        )
    return selected.long()


# --- vLLM -------------------------------------------------------------------------------------------------


def routing_from_vllm(
    routed_experts: Any | Sequence[Any], attention_mask: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """vLLM's `CompletionOutput.routed_experts` ([seq_len, num_moe_layers, top_k] integers, numpy or torch; or
    the CompletionOutput itself) as `replay_routing` input: one LongTensor [num_tokens, top_k] per layer.

    - One array: its rows in order, for a forward over that one sequence.
    - A list of arrays (one per sequence) without `attention_mask`: concatenated, for a batch without padding
      (rows are flattened row-major from [batch, seq]).
    - A list with `attention_mask` [batch, seq]: sequence b's rows go to the positions where row b of the mask
      is 1, in order (left or right padding alike), at flat row `b * seq + s`. Padding positions get experts
      0..top_k-1: the attention mask hides padding tokens from every real token, and each token's MoE output
      depends only on itself, so this choice changes no real token's output (beyond float round-off: the
      experts batch each expert's tokens together, and padding changes those batch sizes).
      A sequence may be one row short of its real tokens: vLLM never feeds back the last generated token, so
      it has no routing; its row is filled the same way (it changes only the logits after the sequence's end).

    vLLM releases that return the prompt's routing separately (`RequestOutput.prompt_routed_experts`, then
    `routed_experts` for the generated tokens only): concatenate the two along axis 0 first.
    """
    arrays = list(routed_experts) if _list_depth(routed_experts) not in (0, 3) else [routed_experts]
    tensors = [_vllm_tensor(array, index) for index, array in enumerate(arrays)]
    num_layers, top_k = tensors[0].shape[1:]
    for index, tensor in enumerate(tensors):
        if tensor.shape[1:] != (num_layers, top_k):
            raise RoutingMismatchError(
                f"routing_from_vllm: sequence {index} has {tensor.shape[1]} layers and top_k {tensor.shape[2]}, "
                f"sequence 0 has {num_layers} layers and top_k {top_k}; all must match."
            )
    if attention_mask is None:
        flat = torch.cat(tensors)
    else:
        flat = _scatter_to_padded(tensors, torch.as_tensor(attention_mask), top_k)
    return [flat[:, layer].contiguous() for layer in range(num_layers)]


def _list_depth(value: Any) -> int:
    """How deep Python lists nest: 0 for an array, 1 for a list of arrays, 3 for one sequence as nested lists
    (vLLM's OpenAI server returns those), 4 for several."""
    depth = 0
    while isinstance(value, (list, tuple)) and value:
        depth, value = depth + 1, value[0]
    return depth


def _vllm_tensor(array: Any, index: int) -> torch.Tensor:
    array = getattr(array, "routed_experts", array)  # a CompletionOutput
    if array is None:
        raise BundleError(
            f"routing_from_vllm: sequence {index} has no routed_experts; start vLLM with "
            "enable_return_routed_experts=True."
        )
    tensor = torch.as_tensor(array)
    if tensor.dim() != 3 or tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        raise RoutingMismatchError(
            f"routing_from_vllm: sequence {index}: expected integers [seq_len, num_layers, top_k], got "
            f"{tensor.dtype} of shape {tuple(tensor.shape)}."
        )
    return tensor.long()


def _scatter_to_padded(tensors: list[torch.Tensor], mask: torch.Tensor, top_k: int) -> torch.Tensor:
    if mask.dim() != 2 or mask.shape[0] != len(tensors):
        raise RoutingMismatchError(
            f"routing_from_vllm: attention_mask must be [batch, seq] with one row per sequence; got shape "
            f"{tuple(mask.shape)} for {len(tensors)} sequences (expected ({len(tensors)}, seq))."
        )
    batch, seq_len = mask.shape
    num_layers = tensors[0].shape[1]
    filler = torch.arange(top_k).expand(batch * seq_len, num_layers, top_k)
    flat = filler.clone()
    for row, tensor in enumerate(tensors):
        positions = mask[row].nonzero().squeeze(1)
        real = positions.numel()
        if tensor.shape[0] not in (real, real - 1):
            raise RoutingMismatchError(
                f"routing_from_vllm: sequence {row} has {tensor.shape[0]} routed tokens, but row {row} of "
                f"attention_mask has {real} real tokens (expected {real}, or {real - 1} when vLLM left out "
                "the last generated token)."
            )
        flat[row * seq_len + positions[: tensor.shape[0]]] = tensor
    return flat


# --- the bundle -------------------------------------------------------------------------------------------


def _selected_experts_recorder(family: Family) -> Installer:
    """Adds `selected_experts` (router output 2) to the family's `_can_record_outputs`, beside its
    `router_logits` (output 0), and returns the exact undo."""

    def install(options: BundleOptions) -> Any:
        module = importlib.import_module(family.modeling_module)
        edited: list[tuple[type, dict, dict]] = []
        for cls in list(vars(module).values()):
            if not isinstance(cls, type) or cls.__module__ != module.__name__:
                continue
            recorders = cls.__dict__.get("_can_record_outputs")
            if isinstance(recorders, dict) and "router_logits" in recorders:
                replacement = {
                    **recorders,
                    SELECTED_EXPERTS: _index_2_recorder(recorders["router_logits"], cls),
                }
                cls._can_record_outputs = replacement
                edited.append((cls, recorders, replacement))
        if not edited:
            raise UnsupportedTransformersError(
                f"{family.modeling_module} in transformers {TRANSFORMERS_VERSION} has no class recording "
                "'router_logits', which the '-replay' bundle extends with 'selected_experts'; please report it."
            )

        def restore() -> None:
            registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", {})
            for cls, original, replacement in reversed(edited):
                cls._can_record_outputs = original
                # Models built meanwhile registered our dict by class name; point them back at the stock one.
                for key, value in list(registry.items()):
                    if value is replacement:
                        dict.__setitem__(registry, key, original)

        return restore

    return install


def _index_2_recorder(router_logits: Any, owner: type) -> OutputRecorder:
    if isinstance(router_logits, OutputRecorder):
        target = router_logits.target_class
        target = getattr(target, "_layerswap_original", target)  # a recorder a load left patched
        return dataclasses.replace(router_logits, target_class=target, index=2)
    if isinstance(router_logits, type):
        return OutputRecorder(getattr(router_logits, "_layerswap_original", router_logits), index=2)
    raise UnsupportedTransformersError(
        f"{owner.__qualname__}._can_record_outputs['router_logits'] is {router_logits!r} in transformers "
        f"{TRANSFORMERS_VERSION}, not an OutputRecorder or class; the '-replay' bundle cannot add "
        "'selected_experts' beside it. Please report it."
    )


def _replay_bundle(family: Family) -> Bundle | None:
    """`<model_type>-replay` for every MoE family whose router returns (logits, scores, indices)."""
    if family.router is None or family.router not in SCORERS:
        return None
    return Bundle(
        name=f"{family.model_type}-replay",
        purpose="replay",
        model_types=(family.model_type,),
        description=(
            f"{family.router} that can replay recorded expert choices (layerswap.replay_routing, e.g. vLLM "
            "rollouts via routing_from_vllm) with weights from the live router, so gradients reach it; adds "
            "output_selected_experts=True to the base model. Composes with the '-quant' bundle."
        ),
        patches=(
            Patch(family.modeling_module, family.router, replayable_router_adapter(SCORERS[family.router])),
        ),
        keep_unquantized=family.keep_unquantized,
        installers=(_selected_experts_recorder(family),),
    )
