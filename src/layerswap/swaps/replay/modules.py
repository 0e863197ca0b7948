"""Replayable MoE routers: with recorded expert choices, route by them instead of the top-k.

Each per-family replacement subclasses the stock router, so `_init_weights` (`isinstance(module, StockRouter)`)
and output recorders (`OutputRecorder(StockRouter, index=0)`) keep matching it. With no replay set it calls the
stock forward unchanged. With a replay set (by `layerswap.replay_routing`) it takes the recorded indices and
recomputes only their weights from the CURRENT router parameters, the way the family computes the weights of the
experts it selects, so gradients reach the router. Everything the family uses only to *choose* experts (score
correction bias, group-limited top-k, Ernie's moe_statics) is skipped: the choice is given. Rows of -1 (tokens
the replay leaves to the router, e.g. vLLM's skipped prompt rows) take the stock forward's own choice first.

Each scorer below mirrors one stock forward line by line (same dtypes, same epsilons), so that replaying a
recording with unchanged weights reproduces the stock logits bit for bit; tests/swaps/replay/test_modules.py checks
that for every family, which is what catches a transformers release that changes a router's math.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..._hf.compat import router_order_shortfall
from ..._hf.discovery import router_forwards
from ...bundle import BundleOptions

# (router, hidden_states, selected [T, K], *the stock forward's other arguments) -> (router_logits, weights [T, K])
Scorer = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class ReplaySource(Protocol):
    """What a replayable router reads its expert choices from (set by layerswap.routing.replay_routing)."""

    # True when some rows are all -1: those tokens take the router's own top-k (e.g. the prompt rows before
    # vLLM's routed_experts_prompt_start), so the router also computes its own choice.
    routes_live: bool

    def take(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """The [num_tokens, top_k] expert indices for the tokens of this call."""
        ...


class ReplayableRouter:
    """Marker base of every replayable router class; the forward is built per family by the adapter."""

    _layerswap_original: type[nn.Module]
    _layerswap_replay: ReplaySource | None = None  # set on the instance while replaying


# --- scorers: the stock weight computation, for given indices --------------------------------------------


def _softmax_weights(router: Any, hidden_states: torch.Tensor, selected: torch.Tensor):
    # qwen2_moe, qwen3_moe, qwen3_next, olmoe, flex_olmo, mellum; qwen3_5_moe and qwen3_vl_moe, whose routers have no
    # norm_topk_prob and always renormalize
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states, router.weight)
    weights = F.softmax(router_logits, dtype=torch.float, dim=-1).gather(-1, selected)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return router_logits, weights.to(router_logits.dtype)


def _softmax_weights_renormalized(router: Any, hidden_states: torch.Tensor, selected: torch.Tensor):
    # mixtral, minimax: always renormalized, left in float32
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states, router.weight)
    weights = F.softmax(router_logits.float(), dim=-1).gather(-1, selected)
    return router_logits, weights / weights.sum(dim=-1, keepdim=True)


def _hunyuan_weights(router: Any, hidden_states: torch.Tensor, selected: torch.Tensor):
    hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])
    if router.wg.weight.dtype == torch.float32:
        hidden_states = hidden_states.float()
    router_logits = router.wg(hidden_states)
    weights = F.softmax(router_logits, dim=1, dtype=torch.float).gather(-1, selected)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return router_logits, weights.to(router_logits.dtype)


def _jamba_weights(router: Any, hidden_states: torch.Tensor, selected: torch.Tensor):
    # softmax over all experts, selected weights left unnormalized
    router_logits = F.linear(hidden_states, router.weight)
    weights = F.softmax(router_logits, dim=-1, dtype=torch.float).gather(-1, selected)
    return router_logits, weights.to(hidden_states.dtype)


def _ernie_weights(router: Any, hidden_states: torch.Tensor, selected: torch.Tensor):
    from transformers.utils.generic import maybe_autocast

    # moe_statics (a correction bias) only selects; the weights come from the plain softmax.
    with maybe_autocast(device_type=hidden_states.device.type, enabled=False):
        router_logits = F.linear(hidden_states.float(), router.weight.float())
        weights = F.softmax(router_logits, dim=1, dtype=torch.float).gather(-1, selected)
        weights = weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=router.norm_min)
    return router_logits, weights.to(hidden_states.dtype)


def _granite_weights(router: Any, hidden_states: torch.Tensor, selected: torch.Tensor):
    # granitemoe, granitemoeshared: softmax over the selected logits only
    router_logits = F.linear(hidden_states, router.weight).float()
    weights = torch.softmax(router_logits.gather(-1, selected), dim=-1).type_as(hidden_states)
    return router_logits, weights


def _cohere2_weights(router: Any, hidden_states: torch.Tensor, selected: torch.Tensor):
    router_logits = F.linear(hidden_states, router.weight)
    selected_logits = router_logits.gather(-1, selected)
    if router.expert_selection_fn == "softmax":
        weights = F.softmax(selected_logits, dim=1, dtype=torch.float)
    elif router.expert_selection_fn == "sigmoid":
        weights = F.sigmoid(selected_logits)
        if router.norm_topk_prob:
            weights = weights / torch.sum(weights, dim=-1, keepdim=True)
    else:
        raise ValueError("`expert_selection_fn` can only be `softmax` or `sigmoid`")
    return router_logits, weights.to(hidden_states.dtype)


def _deepseek_v2_weights(router: Any, hidden_states: torch.Tensor, selected: torch.Tensor):
    # Both topk methods ("greedy", "group_limited_greedy") weigh a chosen expert by its plain softmax score.
    hidden_states = hidden_states.view(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states.type(torch.float32), router.weight.type(torch.float32))
    weights = router_logits.softmax(dim=-1, dtype=torch.float32).gather(-1, selected)
    return router_logits, weights * router.routed_scaling_factor


def _sigmoid_weights(router: Any, hidden_states: torch.Tensor, selected: torch.Tensor):
    # deepseek_v3 and its copies: e_score_correction_bias and group top-k only select; weights are the sigmoid.
    hidden_states = hidden_states.view(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states.type(torch.float32), router.weight.type(torch.float32))
    weights = router_logits.sigmoid().gather(1, selected)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, weights * router.routed_scaling_factor


def _minimax_m2_weights(
    router: Any,
    hidden_states: torch.Tensor,
    selected: torch.Tensor,
    e_score_correction_bias: torch.Tensor | None = None,
):
    # minimax_m2 passes its correction bias in; step3p7 and minimax_m3_vl read it off the router. It only selects.
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states.to(router.weight.dtype), router.weight)
    weights = F.sigmoid(router_logits.float()).gather(1, selected)
    return router_logits, weights / weights.sum(dim=-1, keepdim=True)


def _lfm2_weights(
    router: Any, hidden_states: torch.Tensor, selected: torch.Tensor, expert_bias: torch.Tensor | None = None
):
    router_logits = F.linear(hidden_states, router.weight)
    weights = router_logits.sigmoid().gather(1, selected)
    if router.use_expert_bias:
        weights = weights.type_as(router_logits)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    return router_logits, weights * router.routed_scaling_factor


def _afmoe_weights(
    router: Any, hidden_states: torch.Tensor, selected: torch.Tensor, expert_bias: torch.Tensor
):
    hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
    router_logits = router.gate(hidden_states).to(torch.float32)
    weights = torch.sigmoid(router_logits).gather(1, selected)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, weights * router.route_scale


def _laguna_weights(router: Any, hidden_states: torch.Tensor, selected: torch.Tensor):
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states, router.weight).float()
    if router.router_logit_softcapping > 0.0:
        cap = router.router_logit_softcapping
        router_logits = torch.tanh(router_logits / cap) * cap
    weights = torch.sigmoid(router_logits).gather(-1, selected)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return router_logits, weights.to(hidden_states.dtype)


def _phimoe_weights(router: Any, hidden_states: torch.Tensor, selected: torch.Tensor):
    """phimoe's sparsemixer with its two selections replaced by the given ones (top_k is always 2).

    Each multiplier is a softmax over the experts within `2 * jitter_eps` (relative) of the best remaining
    score (a replayed expert outside that window gets weight 0, as stock would give it); in training, stock
    sparsemixer passes it through PhimoeMultiplier (Heun's third-order gradient
    estimate, with a random midpoint mask), and so does this. Training-mode replay draws other random numbers
    than stock (stock also samples the experts), so it matches stock only in distribution.
    """
    if router.training and router.input_jitter_noise > 0:
        hidden_states *= torch.empty_like(hidden_states).uniform_(
            1.0 - router.input_jitter_noise, 1.0 + router.input_jitter_noise
        )
    router_logits = F.linear(hidden_states, router.weight, router.bias)
    first, second = selected[:, :1], selected[:, 1:2]
    multiplier = _sparsemixer_multiplier(router, router_logits, router_logits, first)
    without_first = torch.scatter(router_logits, -1, first, float("-inf"))
    multiplier_top2 = _sparsemixer_multiplier(router, router_logits, without_first, second)
    return router_logits, torch.concat((multiplier, multiplier_top2), dim=-1)


def _sparsemixer_multiplier(
    router: Any, scores: torch.Tensor, candidates: torch.Tensor, chosen: torch.Tensor
) -> torch.Tensor:
    with torch.no_grad():
        threshold = candidates.max(dim=-1, keepdim=True).values
        factor = scores.abs().clamp(min=threshold)
        outside = ((threshold - scores) / factor) > (2 * router.router_jitter_noise)
    gates = torch.softmax(candidates.masked_fill(outside, float("-inf")), dim=-1)
    multiplier = gates.gather(dim=-1, index=chosen)
    if not router.training:
        return multiplier
    from transformers.models.phimoe.modeling_phimoe import PhimoeMultiplier

    max_scores, max_index = gates.max(dim=-1, keepdim=True)
    mask_for_one = torch.logical_or(chosen == max_index, torch.rand_like(max_scores) > 0.75)
    mask_for_one = torch.add(0.3333, mask_for_one, alpha=0.6667).type_as(gates)
    return PhimoeMultiplier.apply(scores, multiplier, chosen, gates, mask_for_one)


def _float32_softmax_weights(router: Any, hidden_states: torch.Tensor, selected: torch.Tensor):
    # lara_mini: logits in float32, cast to the input's dtype at the end
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states.float(), router.weight.float())
    weights = F.softmax(router_logits, dim=-1).gather(-1, selected)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return router_logits, weights.to(hidden_states.dtype)


def _mistral4_weights(router: Any, hidden_states: torch.Tensor, selected: torch.Tensor):
    # group-limited top-k over softmax scores (which only selects), weights the plain softmax
    hidden_states = hidden_states.view(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states, router.weight)
    weights = router_logits.softmax(-1).gather(1, selected)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, weights * router.routed_scaling_factor


def _beam_weights(router: Any, hidden_states: torch.Tensor, selected: torch.Tensor):
    # deepseek_v3's math with routed_scaling_factor applied after the experts, not here
    hidden_states = hidden_states.view(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states.float(), router.weight.float())
    weights = router_logits.sigmoid().gather(1, selected)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, weights


def _flint_weights(router: Any, hidden_states: torch.Tensor, selected: torch.Tensor):
    from transformers.utils.generic import maybe_autocast

    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    with maybe_autocast(device_type=hidden_states.device.type, enabled=False):
        router_logits = F.linear(hidden_states.float(), router.weight.float())
    weights = router_logits.sigmoid().gather(-1, selected)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return router_logits, weights


def _inkling2_weights(router: Any, hidden_states: torch.Tensor, selected: torch.Tensor):
    # the router's own score function (sigmoid or softmax) in float32; the correction bias only selects
    router_logits = F.linear(hidden_states.float().reshape(-1, router.hidden_dim), router.weight)
    weights = router.score_fn(router_logits).gather(1, selected)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, weights * router.routed_scaling_factor


def _longcat_weights(router: Any, hidden_states: torch.Tensor, selected: torch.Tensor):
    # float32 softmax over real and identity experts (the classifier's bias is not used), scaled
    hidden_states = hidden_states.view(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states.type(torch.float32), router.classifier.weight.type(torch.float32))
    weights = router_logits.softmax(dim=-1).gather(1, selected) * router.routed_scaling_factor
    return router_logits, weights.to(router_logits.dtype)


# Stock router class name -> the scorer mirroring its forward. Every router in the catalog returns
# (router_logits, router_scores, router_indices) and is covered.
SCORERS: dict[str, Scorer] = {
    **dict.fromkeys(
        (
            "Qwen2MoeTopKRouter",
            "Qwen3MoeTopKRouter",
            "Qwen3NextTopKRouter",
            "OlmoeTopKRouter",
            "FlexOlmoTopKRouter",
            "MellumTopKRouter",
        ),
        _softmax_weights,
    ),
    **dict.fromkeys(("MixtralTopKRouter", "MiniMaxTopKRouter"), _softmax_weights_renormalized),
    **dict.fromkeys(
        (
            "DeepseekV3TopkRouter",
            "Glm4MoeTopkRouter",
            "Glm4MoeLiteTopkRouter",
            "Dots1TopkRouter",
            "ExaoneMoeTopkRouter",
            "SolarOpenTopkRouter",
            "MiMoV2FlashTopkRouter",
            "KimiLinearTopkRouter",
            "BailingHybridTopkRouter",
        ),
        _sigmoid_weights,
    ),
    **dict.fromkeys(("GraniteMoeTopKRouter", "GraniteMoeSharedTopKRouter"), _granite_weights),
    "DeepseekV2TopkRouter": _deepseek_v2_weights,
    "MiniMaxM2TopKRouter": _minimax_m2_weights,
    "Ernie4_5_MoeTopKRouter": _ernie_weights,
    "HunYuanMoEV1Gate": _hunyuan_weights,
    "PhimoeTopKRouter": _phimoe_weights,
    "JambaTopKRouter": _jamba_weights,
    "Cohere2MoeTopKRouter": _cohere2_weights,
    "Lfm2MoeTopKRouter": _lfm2_weights,
    "AfmoeTokenChoiceRouter": _afmoe_weights,
    "LagunaTopKRouter": _laguna_weights,
    **dict.fromkeys(("Qwen3_5MoeTopKRouter", "Qwen3VLMoeTextTopKRouter"), _softmax_weights),
    "LaraMiniTopKRouter": _float32_softmax_weights,
    **dict.fromkeys(("Step3p7TopKRouter", "MiniMaxM3VLTopKRouter"), _minimax_m2_weights),
    "Mistral4TopkRouter": _mistral4_weights,
    # Its group scoring is optional, and only selects: the weights are deepseek_v3's.
    "AXK2TopkRouter": _sigmoid_weights,
    "BeamTopKRouter": _beam_weights,
    "FlintTopKRouter": _flint_weights,
    "Inkling2TopKRouter": _inkling2_weights,
    "LongcatFlashTopkRouter": _longcat_weights,
}

# Routers of hand-written rows that no scorer can serve, and why.
UNREPLAYABLE: dict[str, str] = {
    "JetMoeTopKGating": "returns the routed rows grouped by expert (sorted indices, rows, gates, counts, logits), "
    "not the (logits, weights, indices) a replayed router returns",
    "Inkling2LoopTopKRouter": "runs once per pass of the looped layers, so one forward makes several choices per "
    "token in one layer, where a recording holds one per MoE layer",
}


def scorer_for(router: str | None) -> Scorer | None:
    """The scorer for the router class `router`: its own in SCORERS, else the one of a router whose forward reads
    exactly the same (transformers' modular copies: glm4v_moe's router is deepseek_v3's), else None (no '-replay'
    bundle for it). The replay tests check each one reproduces stock logits bit for bit."""
    if router is None or router in UNREPLAYABLE:
        return None
    return SCORERS.get(router) or _derived_scorers().get(router)


@functools.cache
def _derived_scorers() -> dict[str, Scorer]:
    bodies = router_forwards()
    by_body: dict[str, set[Scorer]] = {}
    for name, scorer in SCORERS.items():
        # A router that returns another order on this release has a forward its scorer was not written for.
        if name in bodies and router_order_shortfall(name) is None:
            by_body.setdefault(bodies[name], set()).add(scorer)
    derived = {}
    for name, body in bodies.items():
        scorers = by_body.get(body, set())
        if name not in SCORERS and len(scorers) == 1:
            derived[name] = next(iter(scorers))
    return derived


# --- the adapter ------------------------------------------------------------------------------------------


def _with_live_choices(
    router: Any,
    original: type[nn.Module],
    selected: torch.Tensor,
    hidden_states: torch.Tensor,
    args: Any,
    kwargs: Any,
) -> torch.Tensor:
    """`selected` with its rows of -1 replaced by the stock forward's own choice for those tokens. The weights are
    then computed for all rows alike by the scorer, which for the stock choice gives the stock weights."""
    live = selected < 0  # whole rows: replay_routing allows -1 only in every entry of a row
    # phimoe's training-mode jitter scales hidden_states in place: the scorer must still see them unscaled.
    own_input = hidden_states.detach().clone() if router.training else hidden_states.detach()
    with torch.no_grad():
        own_choice = original.forward(router, own_input, *args, **kwargs)[2]
    return torch.where(live, own_choice.to(selected.dtype).reshape(selected.shape), selected)


def replayable_router_adapter(scorer: Scorer) -> Callable[[type[nn.Module], BundleOptions], type[nn.Module]]:
    """An AdapterFactory: the subclass of a stock router that replays expert choices, weighing them by
    `scorer`."""

    def build(original: type[nn.Module], options: BundleOptions) -> type[nn.Module]:
        name = f"Replayable{original.__name__}"

        def forward(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
            replay = self._layerswap_replay
            if replay is None:
                return original.forward(self, hidden_states, *args, **kwargs)
            num_tokens = hidden_states.numel() // hidden_states.shape[-1]
            selected = replay.take(num_tokens, hidden_states.device)
            if replay.routes_live:
                selected = _with_live_choices(self, original, selected, hidden_states, args, kwargs)
            router_logits, weights = scorer(self, hidden_states, selected, *args, **kwargs)
            return router_logits, weights, selected

        # The registry checks a replacement's forward against the stock one by signature; ours takes the same
        # arguments (a bias tensor for minimax_m2 / lfm2_moe / afmoe) and passes them on.
        forward.__signature__ = inspect.signature(original.forward)  # type: ignore[attr-defined]
        forward.__qualname__ = f"{name}.forward"
        return type(
            name,
            (ReplayableRouter, original),
            {
                "forward": forward,
                "_layerswap_original": original,
                "__module__": __name__,
                "__doc__": f"{original.__name__} that can replay recorded expert choices (layerswap).",
            },
        )

    return build
