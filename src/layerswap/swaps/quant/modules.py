"""LinearExperts: MoE experts as an nn.ModuleList of plain nn.Linear, so every quantizer sees them.

One generic adapter serves every family whose Experts class has the stock v5 layout ("group A"):
`gate_up_proj [E, 2I, H]` (gate rows first), `down_proj [E, H, I]`, no bias, `act_fn(gate) * up`.
It does not subclass the stock class: `_init_weights` would initialise the 3D parameters it no longer has.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..._hf.compat import TRANSFORMERS_VERSION
from ..._hf.experts import configured_implementation, layout_mismatches, own_gate
from ...bundle import BundleOptions
from ...errors import ExpertsImplementationError, UnsupportedTransformersError
from ...quantized import is_quantized_linear
from .._stock_layout import ExpertNames, stock_experts_layout
from .conversion import FusedToLinearExperts


class StockGate:
    """The stock class's own `_apply_gate` (a clamped SwiGLU, say), applied to one expert's gate and up outputs
    concatenated as the stock fused projection returns them. It runs on a copy of the stock module's plain
    attributes and child modules (the clamp limit, the activation), so it holds no weights."""

    def __init__(self, apply_gate: Callable[[Any, torch.Tensor], torch.Tensor], reference: nn.Module) -> None:
        self.apply_gate = apply_gate
        attributes = {k: v for k, v in vars(reference).items() if not k.startswith("_")}
        self._stock = SimpleNamespace(**attributes, **dict(reference.named_children()))

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.apply_gate(self._stock, torch.cat([gate, up], dim=-1))


class ExpertMLP(nn.Module):
    """One expert: down(act(gate(x)) * up(x)), each projection a plain nn.Linear without bias; with `stock_gate`,
    down(stock_gate(gate(x), up(x))) instead."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act_fn: nn.Module | None,
        names: ExpertNames,
        stock_gate: StockGate | None = None,
    ) -> None:
        super().__init__()
        self.names = names
        self.add_module(names.gate, nn.Linear(hidden_size, intermediate_size, bias=False))
        self.add_module(names.up, nn.Linear(hidden_size, intermediate_size, bias=False))
        self.add_module(names.down, nn.Linear(intermediate_size, hidden_size, bias=False))
        self.act_fn = act_fn
        self.stock_gate = stock_gate

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Looked up by name on every call: quantizers replace the Linear children in place.
        gate = getattr(self, self.names.gate)(hidden_states)
        up = getattr(self, self.names.up)(hidden_states)
        hidden = self.act_fn(gate) * up if self.stock_gate is None else self.stock_gate(gate, up)
        return getattr(self, self.names.down)(hidden)


class LinearExperts(nn.ModuleList):
    """Drop-in for a group-A Experts module, with the same forward contract:
    `forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`.

    Per-family subclasses set `_layerswap_original` (the stock class, used to read shapes and the activation
    from the config exactly as the family does) and `expert_names`.
    """

    _layerswap_original: type[nn.Module]
    _layerswap_strict = True  # a checkpoint lacking these weights is an error, never a random init
    _layerswap_bundle = "<model_type>-quant"
    expert_names: ExpertNames = ExpertNames()

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        reference = _stock_reference(self._layerswap_original, config, args, kwargs)
        num_experts, twice_intermediate, hidden_size = reference.gate_up_proj.shape
        intermediate_size = twice_intermediate // 2
        # Experts that compute their own gate (deepseek_v4's clamped SwiGLU) keep computing it.
        apply_gate = own_gate(self._layerswap_original)
        stock_gate = StockGate(apply_gate, reference) if apply_gate is not None else None
        act_fn = getattr(reference, "act_fn", None)
        super().__init__(
            ExpertMLP(hidden_size, intermediate_size, act_fn, self.expert_names, stock_gate)
            for _ in range(num_experts)
        )
        self.config = config
        self.num_experts = num_experts
        self.hidden_dim = hidden_size
        self.intermediate_dim = intermediate_size
        # What the config said when the model was built (grouped_mm unless asked otherwise); see
        # _check_experts_implementation.
        self._built_experts_implementation = configured_implementation(config)

    def _layerswap_check_experts_implementation(self, requested: str) -> None:
        """Called by `model.set_experts_implementation` (while a bundle is enabled) before anything changes."""
        if requested != "eager":
            raise self._experts_implementation_error(requested, "was asked for")

    def _check_experts_implementation(self) -> None:
        # A change made without the bundle's hook (after disable_bundle) is caught when the experts run.
        current = configured_implementation(self.config)
        if current not in ("eager", self._built_experts_implementation):
            raise self._experts_implementation_error(current, "is set in the config")

    def _experts_implementation_error(self, requested: Any, how: str) -> Exception:
        bundle = self._layerswap_bundle
        return ExpertsImplementationError(
            f"experts_implementation={requested!r} {how}, but bundle {bundle!r} replaced "
            f"{self._layerswap_original.__name__} with {type(self).__name__}: plain nn.Linear layers per expert, "
            f"computed one expert at a time, with no fused 3D weights for {requested!r} to run on. Keep 'eager' "
            f"(what these experts compute), or load the model without the bundle "
            f"(layerswap.disable_bundle({bundle!r}) before from_pretrained) to use {requested!r}; "
            f"'{bundle.rsplit('-', 1)[0]}-fast' keeps the stock weights and honours experts_implementation."
        )

    # While transformers builds a model (inside `apply_patches`) the family's `_init_weights` sees this class under
    # the stock name and initialises `gate_up_proj` / `down_proj`. Each expert's nn.Linear gets the same
    # normal(0, initializer_range) init from the nn.Linear branch, so these shape-only meta stand-ins make the
    # stock call a harmless no-op. No other transformers code reads these attributes.
    @property
    def gate_up_proj(self) -> torch.Tensor:
        return torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim, device="meta")

    @property
    def down_proj(self) -> torch.Tensor:
        return torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim, device="meta")

    # --- what the loading hooks ask a swapped module (layerswap._hf) ---

    @classmethod
    def _layerswap_tp_plan(cls, owner: str, leaf: str, style: str) -> dict[str, str] | None:
        """Each expert is a plain MLP, sharded as a dense one is: gate and up colwise, down rowwise (which sums the
        partial outputs itself, so the module-level `moe_tp_experts` entry goes: it would sum them twice)."""
        names = cls.expert_names
        if leaf == "gate_up_proj":
            return {f"{owner}.*.{names.gate}": "colwise", f"{owner}.*.{names.up}": "colwise"}
        if leaf == "down_proj":
            return {f"{owner}.*.{names.down}": "rowwise"}
        return {} if not leaf else None

    def _layerswap_conversions_kept_when_quantized(self) -> tuple[type, ...]:
        """Quantized experts cannot be stacked into fused 3D tensors on save: they save one by one, as loaded."""
        return (FusedToLinearExperts,) if any(is_quantized_linear(m) for m in self.modules()) else ()

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        self._check_experts_implementation()
        output = torch.zeros_like(hidden_states)
        top_k = top_k_index.shape[-1]
        with torch.no_grad():
            flat_experts = top_k_index.reshape(-1)
            order = torch.argsort(flat_experts, stable=True)
            # minlength E + 1: index E is the "not on this rank" sentinel of expert parallelism; it is skipped.
            counts = torch.bincount(flat_experts, minlength=self.num_experts + 1).tolist()
        routed = sum(counts[: self.num_experts])
        token_of_pair = (order // top_k)[:routed]
        weight_of_pair = top_k_weights.reshape(-1)[order[:routed], None]
        # One gather of the routed rows, grouped by expert; each expert reads a contiguous slice of it, and one
        # index_add_ sums the weighted outputs per token in the same (expert) order as a per-expert add would.
        rows = hidden_states[token_of_pair]
        outputs = []
        start = 0
        for expert_index, count in enumerate(counts[: self.num_experts]):
            if count:
                outputs.append(self[expert_index](rows[start : start + count]))
            start += count
        if outputs:
            weighted = torch.cat(outputs) * weight_of_pair
            output.index_add_(0, token_of_pair, weighted.to(output.dtype))
        return output


def _stock_reference(original: type[nn.Module], config: Any, args: tuple, kwargs: dict) -> nn.Module:
    """The stock module, built on the meta device (no memory), to read its shapes and activation."""
    with torch.device("meta"):
        reference = original(config, *args, **kwargs)
    # The expert-parallel flag does not matter: forward skips the "not on this rank" index as stock does.
    mismatches = layout_mismatches(reference, expert_parallel_ok=True)
    shapes_ok = (
        getattr(reference, "gate_up_proj", None) is not None
        and getattr(reference, "down_proj", None) is not None
        and reference.gate_up_proj.dim() == 3
        and reference.down_proj.shape[0] == reference.gate_up_proj.shape[0]
        and reference.down_proj.shape[1] == reference.gate_up_proj.shape[2]
        and 2 * reference.down_proj.shape[2] == reference.gate_up_proj.shape[1]
    )
    has_gate = hasattr(reference, "act_fn") or own_gate(original) is not None
    if mismatches or not shapes_ok or not has_gate:
        found = {flag: value for flag, value, _ in mismatches}
        raise UnsupportedTransformersError(
            f"{original.__module__}.{original.__qualname__} in transformers {TRANSFORMERS_VERSION} does not have "
            f"the stock fused-experts layout LinearExperts expects (found {found}, "
            f"gate_up_proj {tuple(getattr(reference, 'gate_up_proj', torch.empty(0)).shape)}). "
            "This family needs its own adapter; please report it."
        )
    return reference


def linear_experts_adapter(model_type: str) -> Any:
    """An AdapterFactory building the LinearExperts subclass that replaces one family's Experts class, with
    the projection names of that family's stock per-expert checkpoints."""

    def build(original: type[nn.Module], options: BundleOptions) -> type[nn.Module]:
        names = stock_experts_layout(model_type).names
        return type(
            f"Linear{original.__name__}",
            (LinearExperts,),
            {
                "_layerswap_original": original,
                "_layerswap_bundle": f"{model_type}-quant",
                "expert_names": names,
                "__module__": __name__,
                "__doc__": f"{original.__name__} as an nn.ModuleList of nn.Linear experts (layerswap).",
            },
        )

    return build
