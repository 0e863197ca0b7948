"""LinearExperts: MoE experts as an nn.ModuleList of plain nn.Linear, so every quantizer sees them.

One generic adapter serves every family whose Experts class is laid out as `@use_experts_implementation`
describes: by default `gate_up_proj [E, 2I, H]` (gate rows first), `down_proj [E, H, I]`, no bias,
`act_fn(gate) * up`; and each flag off its default (transposed `[E, in, out]` weights, biases, interleaved gate/up
rows, no gate), with the class's own `_apply_gate` where it has one (gpt_oss's clamped SwiGLU). It does not subclass
the stock class: `_init_weights` would initialise the 3D parameters it no longer has.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Mapping
from types import MappingProxyType, SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..._hf.compat import TRANSFORMERS_VERSION
from ..._hf.experts import configured_implementation, layout_mismatches, own_gate
from ...bundle import BundleOptions, ExpertsFlags
from ...errors import (
    ExpertParallelismError,
    ExpertsImplementationError,
    LayerswapWarning,
    UnsupportedTransformersError,
)
from ...kernels import cpu_dispatch, torch_moe
from ...quantized import is_quantized_linear
from .._stock_layout import ExpertNames, stock_experts_layout
from .all_experts import DEFAULT_CHUNK_SIZE, pipeline_requests_all_experts
from .conversion import FusedToLinearExperts


class StockGate:
    """The stock class's own `_apply_gate` (a clamped SwiGLU, say), applied to one expert's gate and up outputs
    joined as the stock fused projection returns them (gate then up, or interleaved). It runs on a copy of the
    stock module's plain attributes and child modules (the clamp limit, the activation), so it holds no weights."""

    def __init__(
        self,
        apply_gate: Callable[[Any, torch.Tensor], torch.Tensor],
        reference: nn.Module,
        flags: ExpertsFlags,
    ) -> None:
        self.apply_gate = apply_gate
        self.is_concatenated = flags.is_concatenated
        attributes = {k: v for k, v in vars(reference).items() if not k.startswith("_")}
        self._stock = SimpleNamespace(**attributes, **dict(reference.named_children()))

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.is_concatenated:
            gate_up = torch.cat([gate, up], dim=-1)
        else:
            gate_up = torch.stack([gate, up], dim=-1).flatten(-2)
        return self.apply_gate(self._stock, gate_up)


class ExpertMLP(nn.Module):
    """One expert: down(act(gate(x)) * up(x)), each projection a plain nn.Linear (with a bias where the stock
    experts have one); with `stock_gate`, down(stock_gate(gate(x), up(x))); without a gate, down(act(up(x)))."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act_fn: nn.Module | None,
        names: ExpertNames,
        stock_gate: StockGate | None = None,
        flags: ExpertsFlags | None = None,
    ) -> None:
        super().__init__()
        flags = flags or ExpertsFlags()
        self.names = names
        self.has_gate = flags.has_gate
        bias = flags.has_bias
        if self.has_gate:
            self.add_module(names.gate, nn.Linear(hidden_size, intermediate_size, bias=bias))
        self.add_module(names.up, nn.Linear(hidden_size, intermediate_size, bias=bias))
        self.add_module(names.down, nn.Linear(intermediate_size, hidden_size, bias=bias))
        self.act_fn = act_fn
        self.stock_gate = stock_gate

    # The norm every expert's output goes through (muse_spark's), owned by the experts module: set with
    # object.__setattr__, so that its weight is a parameter of the experts module alone, saved once.
    post_norm: nn.Module | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Looked up by name on every call: quantizers replace the Linear children in place.
        up = getattr(self, self.names.up)(hidden_states)
        if not self.has_gate:
            hidden = self.act_fn(up)
        else:
            gate = getattr(self, self.names.gate)(hidden_states)
            hidden = self.act_fn(gate) * up if self.stock_gate is None else self.stock_gate(gate, up)
        output = getattr(self, self.names.down)(hidden)
        return output if self.post_norm is None else self.post_norm(output)

    def plain_projections(self, dtype: torch.dtype) -> cpu_dispatch.ExpertWeights | None:
        """(gate or None, up, down) weights where this expert computes exactly down(act(gate(x)) * up(x)) (or
        down(act(up(x)))) through plain nn.Linear layers without bias, in `dtype`, on the CPU, with no hook or
        replaced forward on it or them: then the MLP may run on another engine than nn.Linear's own. None
        where anything could observe or change the calls (a quantized, LoRA or offloaded layer, a calibration
        hook, a parametrization): those always run module by module."""
        if self.stock_gate is not None or self.post_norm is not None or _observed(self):
            return None
        names = (self.names.gate,) if self.has_gate else ()
        weights = []
        for name in (*names, self.names.up, self.names.down):
            linear = getattr(self, name)
            if type(linear) is not nn.Linear or _observed(linear):
                return None
            # Its weight alone: no bias, and nothing a quantizer may keep beside it (scales, zero points).
            parameters = [name for name, _ in linear.named_parameters(recurse=False)]
            if parameters != ["weight"] or next(linear.buffers(recurse=False), None) is not None:
                return None
            weight = linear.weight
            if type(weight) is not nn.Parameter or weight.dtype != dtype or weight.device.type != "cpu":
                return None
            weights.append(weight)
        return (None, *weights) if not self.has_gate else tuple(weights)


def _observed(module: nn.Module) -> bool:
    """Whether a hook, a forward set on the instance (accelerate's offloading) or `module.compile()` would see or
    change this module's call."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or "forward" in module.__dict__
        or getattr(module, "_compiled_call_impl", None) is not None
    )


class RemoteExpert(nn.Module):
    """Stands where an expert that another rank holds under expert parallelism would be: no weights. The
    expert-parallel dispatch never routes a token to it."""

    def __init__(self, index: int, rank: int) -> None:
        super().__init__()
        self.index, self.rank = index, rank

    def extra_repr(self) -> str:
        return f"expert={self.index}, held_by_rank={self.rank}"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            f"expert {self.index} is held by rank {self.rank} under expert parallelism; this rank cannot run it "
            "(the expert-parallel dispatch sends each rank only routes to its own experts)"
        )


class LinearExperts(nn.ModuleList):
    """Drop-in for a group-A Experts module, with the same forward contract:
    `forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`.

    Per-family subclasses set `_layerswap_original` (the stock class, used to read shapes and the activation
    from the config exactly as the family does) and `expert_names`.
    """

    _layerswap_original: type[nn.Module]
    _layerswap_strict = True  # a checkpoint lacking these weights is an error, never a random init
    # Per-expert modules named as transformers v4 named them: PEFT must target them as written (peft_adapters).
    _layerswap_per_expert_modules = True
    _layerswap_bundle = "<model_type>-quant"
    # The family's layout where its class declares none (llama4's transposed experts are undecorated).
    _layerswap_flags: ExpertsFlags | None = None
    expert_names: ExpertNames = ExpertNames()
    # Sub-models whose checkpoints name the projections otherwise, by config model type (dots3_note's vision
    # tower: fc1, fc3, fc2 where its text model has gate_proj, up_proj, down_proj).
    _layerswap_names_by_model_type: Mapping[str, ExpertNames] = MappingProxyType({})
    # Set by layerswap.calibrate_all_experts: run every expert on the tokens not routed to it too, this many at once.
    _layerswap_all_experts_chunk: int | None = None
    # Set when a no-grad CPU call found no expert that could take a measured engine (all quantized or observed).
    _layerswap_no_plain_experts = False
    # Under expert parallelism, the experts (global indices) this rank holds; None: it holds them all.
    _layerswap_held_experts: range | None = None
    # Why these experts cannot be split by expert (None: they can).
    _layerswap_expert_parallel_refusal: str | None = None

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        # The stock module, built on the meta device (no memory), to read its shapes and activation.
        with torch.device("meta"):
            reference = self._layerswap_original(config, *args, **kwargs)
        num_experts, hidden_size, intermediate_size, flags, act_fn = self._read_stock(reference)
        # Experts that compute their own gate (deepseek_v4's clamped SwiGLU) keep computing it.
        apply_gate = own_gate(self._layerswap_original)
        stock_gate = StockGate(apply_gate, reference, flags) if apply_gate is not None else None
        self.expert_names = self._layerswap_names_by_model_type.get(
            getattr(config, "model_type", None), self.expert_names
        )
        super().__init__(
            ExpertMLP(hidden_size, intermediate_size, act_fn, self.expert_names, stock_gate, flags)
            for _ in range(num_experts)
        )
        if flags.has_post_expert_norm and not isinstance(self, LinearPostNormExperts):
            raise UnsupportedTransformersError(
                f"{self._layerswap_original.__name__} applies a norm after each expert, which "
                f"{type(self).__name__} does not; build it with linear_experts_adapter, which picks "
                "LinearPostNormExperts."
            )
        self.config = config
        self.num_experts = num_experts  # this rank's count under expert parallelism, as transformers expects
        self.num_global_experts = num_experts
        self.hidden_dim = hidden_size
        self.intermediate_dim = intermediate_size
        self.flags = flags
        # The stock parameters' shapes, for the meta stand-ins below.
        self._stock_shapes = {name: tuple(p.shape) for name, p in reference.named_parameters(recurse=False)}
        # What the config said when the model was built (grouped_mm unless asked otherwise); see
        # _check_experts_implementation.
        self._built_experts_implementation = configured_implementation(config)
        self._adopt_from_stock(reference)

    def _adopt_from_stock(self, reference: nn.Module) -> None:
        """Take what a subclass keeps of the stock module besides its experts (LinearPostNormExperts: the norm),
        from the meta-device `reference` built once above."""

    @property
    def _layerswap_stock_parameter_names(self) -> tuple[str, ...]:
        """The stock module's parameters, as a v5 checkpoint names them (`gate_up_proj`, `down_proj`, ...)."""
        return tuple(self._stock_shapes)

    @classmethod
    def _read_stock(cls, reference: nn.Module) -> tuple[int, int, int, ExpertsFlags, Any]:
        """(experts, hidden size, intermediate size, layout, activation) of the stock module."""
        flags = _stock_layout_of(cls._layerswap_original, reference, cls._layerswap_flags)
        up = reference.gate_up_proj if flags.has_gate else reference.up_proj
        num_experts, *dims = up.shape
        hidden_size, fused_size = dims if flags.is_transposed else dims[::-1]
        intermediate_size = fused_size // 2 if flags.has_gate else fused_size
        return num_experts, hidden_size, intermediate_size, flags, getattr(reference, "act_fn", None)

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
    # the stock name and initialises `gate_up_proj` / `down_proj` (and their biases). Each expert's nn.Linear gets
    # the same normal(0, initializer_range) init from the nn.Linear branch, so these shape-only meta stand-ins make
    # the stock call a harmless no-op. No other transformers code reads these attributes.
    def _stand_in(self, name: str) -> torch.Tensor:
        shape = self.__dict__["_stock_shapes"].get(name)
        if shape is None:
            raise AttributeError(f"{type(self).__name__} has no {name} (the stock class has none either)")
        return torch.empty(shape, device="meta")

    gate_up_proj = property(lambda self: self._stand_in("gate_up_proj"))
    up_proj = property(lambda self: self._stand_in("up_proj"))
    down_proj = property(lambda self: self._stand_in("down_proj"))
    gate_up_proj_bias = property(lambda self: self._stand_in("gate_up_proj_bias"))
    up_proj_bias = property(lambda self: self._stand_in("up_proj_bias"))
    down_proj_bias = property(lambda self: self._stand_in("down_proj_bias"))

    # --- what the loading hooks ask a swapped module (layerswap._hf) ---

    @classmethod
    def _layerswap_tp_plan(cls, owner: str, leaf: str, style: str) -> dict[str, str] | None:
        """Each expert is a plain MLP, sharded as a dense one is: gate and up colwise, down rowwise (which sums the
        partial outputs itself, so the module-level `moe_tp_experts` entry goes: it would sum them twice)."""
        names = cls.expert_names
        if leaf == "gate_up_proj":
            return {f"{owner}.*.{names.gate}": "colwise", f"{owner}.*.{names.up}": "colwise"}
        if leaf == "up_proj":  # gate-less experts
            return {f"{owner}.*.{names.up}": "colwise"}
        if leaf == "down_proj":
            return {f"{owner}.*.{names.down}": "rowwise"}
        if leaf.endswith("_bias"):  # each nn.Linear's plan shards its bias with its weight
            return {}
        return {} if not leaf else None

    @classmethod
    def _layerswap_ep_plan(cls, owner: str, leaf: str, style: str) -> dict[str, str] | None:
        """The module's expert-parallel dispatch entry stays; the entries for the stock 3D parameters go: the experts
        split themselves, whole experts per rank, when transformers installs the dispatch
        (`_layerswap_shard_experts`)."""
        return {owner: style} if not leaf else {}

    def _layerswap_check_expert_parallel(self, name: str, ep_size: int, dp_size: int) -> None:
        """Refuse, before any weight is loaded, expert parallelism these experts cannot take (the expert count itself
        is checked for every swapped experts module, by `_hf.parallel`)."""
        tensor_parallel = (
            "tensor parallelism instead (tp_plan='auto', or DistributedConfig(tp_size=N) without ep_size), which "
            "splits every expert's nn.Linear over the ranks"
        )
        if self._layerswap_expert_parallel_refusal is not None:
            raise ExpertParallelismError(
                f"Expert parallelism over ep_size={ep_size} ranks cannot split {name} "
                f"({type(self).__name__}, bundle {self._layerswap_bundle!r}) by expert: "
                f"{self._layerswap_expert_parallel_refusal}. Use {tensor_parallel}."
            )
        if dp_size > 1:
            raise ExpertParallelismError(
                f"Expert parallelism (ep_size={ep_size}) with data parallelism (FSDP, dp_size={dp_size}) is not "
                f"served for {name} ({type(self).__name__}, bundle {self._layerswap_bundle!r}): its experts split "
                "by expert only alongside tensor parallelism. Use DistributedConfig(tp_size=N, ep_size=N), FSDP "
                f"without ep_size, or {tensor_parallel}."
            )

    def _layerswap_shard_experts(self, rank: int, size: int) -> None:
        """Keep only the experts rank `rank` of `size` holds under expert parallelism (a contiguous block, as
        transformers' expert-parallel plan splits stacked 3D experts); the others become weightless RemoteExperts,
        so they are neither loaded nor kept in memory. Called by `_hf` when transformers installs the dispatch,
        before any weight is loaded; `num_experts` becomes this rank's count, the dispatch's local expert ids."""
        if self._layerswap_held_experts is not None:
            return
        count = self.num_global_experts // size
        held = range(rank * count, (rank + 1) * count)
        for index in range(self.num_global_experts):
            if index not in held:
                self[index] = RemoteExpert(index, index // count)
        self._layerswap_held_experts = held
        self.num_experts = count

    def _expert(self, local_index: int) -> nn.Module:
        """The expert with this rank's (the dispatch's) index: the global one where this rank holds every expert."""
        held = self._layerswap_held_experts
        return self[local_index if held is None else held.start + local_index]

    # --- what calibrate_all_experts asks ---

    # Why calibrate_all_experts cannot run these experts on the tokens not routed to them (None: it can).
    _layerswap_calibration_refusal: str | None = None

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
        chunk_size = self._all_experts_chunk_size()
        ops = self._cpu_engines(rows) if chunk_size is None else None
        outputs: list[torch.Tensor | None] = []
        on_kernel: list[tuple[int, cpu_dispatch.ExpertWeights]] = []  # (index in outputs, weights)
        bounds: list[int] = []
        start = 0
        for expert_index, count in enumerate(counts[: self.num_experts]):
            if count:
                expert = self._expert(expert_index)
                piece = rows[start : start + count]
                op = "row" if ops is None else ops[torch_moe.row_class(count)]
                plain = op != "row" and type(expert) is ExpertMLP
                weights = expert.plain_projections(piece.dtype) if plain else None
                if weights is None:
                    outputs.append(expert(piece))
                elif op == "skinny" and torch_moe.batches_on_kernel(piece, weights, expert.act_fn):
                    on_kernel.append((len(outputs), weights))  # below, with the others, in one call
                    bounds += (start, start + count)
                    outputs.append(None)
                else:
                    outputs.append(torch_moe.linear_expert_mlp(piece, *weights, expert.act_fn, op))
            start += count
        if on_kernel:
            kernel_out = torch_moe.linear_experts_on_kernel(
                rows, [weights for _, weights in on_kernel], bounds, torch.empty_like(rows)
            )
            for number, (position, _) in enumerate(on_kernel):
                outputs[position] = kernel_out[bounds[2 * number] : bounds[2 * number + 1]]
        if outputs:
            # In place: no second [pairs, H] tensor of fresh memory.
            weighted = torch.cat(outputs).mul_(weight_of_pair)
            output.index_add_(0, token_of_pair, weighted.to(output.dtype))
        if chunk_size is not None:
            self._run_experts_on_unrouted_tokens(hidden_states, top_k_index, chunk_size)
        return output

    def _cpu_engines(self, rows: torch.Tensor) -> tuple[str, ...] | None:
        """For a no-grad CPU call that nothing observes: the engine per row-count class this machine measured
        fastest for these experts (`cpu_dispatch.linear_expert_ops`; all "row", nn.Linear's own `x @ W.T`,
        where nothing beats it). Experts that are not plain (`ExpertMLP.plain_projections`) still run module
        by module. None: every expert runs its modules."""
        if (
            torch.is_grad_enabled()
            or rows.device.type != "cpu"
            or torch.compiler.is_compiling()
            or torch.is_autocast_enabled("cpu")  # nn.Linear's F.linear would run in the autocast dtype
            or torch._C._is_torch_function_mode_enabled()  # a mode that intercepts F.linear would be bypassed
            or nn.modules.module._global_forward_hooks
            or nn.modules.module._global_forward_pre_hooks
        ):
            return None
        first = self._expert(0)
        if self._layerswap_no_plain_experts or type(first) is not ExpertMLP or first.act_fn is None:
            return None
        scanned: list[list[cpu_dispatch.ExpertWeights]] = []

        def plain_experts() -> list[cpu_dispatch.ExpertWeights]:
            held = (self._expert(i).plain_projections(rows.dtype) for i in range(self.num_experts))
            scanned.append([weights for weights in held if weights is not None])
            return scanned[-1]

        shape = (self.num_experts, self.hidden_dim, self.intermediate_dim, first.has_gate)
        ops = cpu_dispatch.linear_expert_ops(rows.dtype, shape, plain_experts, first.act_fn)
        if scanned and not scanned[-1]:
            # Every expert of this layer quantized or observed: none can take an engine, so this layer stops asking
            # (the scan costs 0.2-0.4 ms at 128 experts). Only this layer: another of the same shape may be plain.
            self._layerswap_no_plain_experts = True
        return None if ops == cpu_dispatch.ALL_ROW else ops

    def _all_experts_chunk_size(self) -> int | None:
        """How many unrouted tokens to run through an expert at once while all-experts calibration is asked for
        (by calibrate_all_experts or a calibration pipeline's switch, see all_experts.py); None otherwise."""
        if self._layerswap_all_experts_chunk is not None:
            return self._layerswap_all_experts_chunk
        if torch.compiler.is_compiling():  # calibration runs eagerly; a compiled graph keeps the routed path
            return None
        return DEFAULT_CHUNK_SIZE if pipeline_requests_all_experts() else None

    def _run_experts_on_unrouted_tokens(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, chunk_size: int
    ) -> None:
        """Each expert on the tokens not routed to it, outputs discarded: the hooks of a calibration pipeline on
        its nn.Linear layers see every token exactly once (the routed ones went through forward)."""
        with torch.no_grad():
            for expert_index in range(self.num_experts):
                unrouted = (top_k_index != expert_index).all(dim=-1).nonzero().squeeze(1)
                for start in range(0, unrouted.numel(), chunk_size):
                    self._expert(expert_index)(hidden_states[unrouted[start : start + chunk_size]])


def _stock_layout_of(
    original: type[nn.Module], reference: nn.Module, declared: ExpertsFlags | None
) -> ExpertsFlags:
    """The stock module's layout: the flags `@use_experts_implementation` set on it, or for an undecorated class
    the family's `declared` ones; an error where LinearExperts cannot reproduce it."""
    # The expert-parallel flag does not matter: forward skips the "not on this rank" index as stock does.
    mismatches = layout_mismatches(reference, expert_parallel_ok=True)
    found = {flag: value for flag, value, _ in mismatches}
    flags = ExpertsFlags.of(found)
    if not hasattr(reference, "has_gate") and declared is not None:
        flags = declared
    unknown = sorted(set(found) - {f.name for f in dataclasses.fields(ExpertsFlags)})
    if (
        not unknown
        and _shapes_ok(reference, flags)
        and (hasattr(reference, "act_fn") or (flags.has_gate and own_gate(original) is not None))
    ):
        return flags
    shapes = {name: tuple(p.shape) for name, p in reference.named_parameters(recurse=False)}
    raise UnsupportedTransformersError(
        f"{original.__module__}.{original.__qualname__} in transformers {TRANSFORMERS_VERSION} has a layout "
        f"LinearExperts does not reproduce (layout flags off the stock ones: {found}; parameters {shapes}"
        + (f"; no adapter knows {unknown}" if unknown else "")
        + "). This family needs its own adapter; please report it."
    )


def _shapes_ok(reference: nn.Module, flags: ExpertsFlags) -> bool:
    """gate_up_proj (or up_proj) and down_proj are consistent [E, out, in] stacks (transposed: [E, in, out]), with
    [E, out] biases where the flags say so."""
    up = getattr(reference, "gate_up_proj" if flags.has_gate else "up_proj", None)
    down = getattr(reference, "down_proj", None)
    if (
        not isinstance(up, torch.Tensor)
        or not isinstance(down, torch.Tensor)
        or up.dim() != 3
        or down.dim() != 3
    ):
        return False
    up_out, up_in = up.shape[1:][::-1] if flags.is_transposed else up.shape[1:]
    down_out, down_in = down.shape[1:][::-1] if flags.is_transposed else down.shape[1:]
    intermediate = up_out // 2 if flags.has_gate else up_out
    ok = (
        up.shape[0] == down.shape[0]
        and down_out == up_in
        and down_in == intermediate
        and (not flags.has_gate or up_out % 2 == 0)
    )
    if flags.has_bias:
        up_bias = getattr(reference, "gate_up_proj_bias" if flags.has_gate else "up_proj_bias", None)
        down_bias = getattr(reference, "down_proj_bias", None)
        ok = ok and all(
            isinstance(b, torch.Tensor) and tuple(b.shape) == (up.shape[0], size)
            for b, size in ((up_bias, up_out), (down_bias, down_out))
        )
    return ok


def linear_experts_adapter(
    bundle: str, model_types: tuple[str, ...], flags: ExpertsFlags | None = None
) -> Any:
    """An AdapterFactory building the LinearExperts subclass that replaces one of a family's Experts classes
    (for `bundle`), with the projection names of the family's stock per-expert checkpoints (`model_types`: the
    family's, its sub-configs' after it)."""

    def build(original: type[nn.Module], options: BundleOptions) -> type[nn.Module]:
        names = stock_experts_layout(*model_types).names
        own = {t: stock_experts_layout(t) for t in model_types}
        attributes = {
            "_layerswap_original": original,
            "_layerswap_bundle": bundle,
            "expert_names": names,
            "_layerswap_names_by_model_type": MappingProxyType(
                {
                    t: layout.names
                    for t, layout in own.items()
                    if layout.per_expert_checkpoints and layout.names != names
                }
            ),
            "_layerswap_flags": flags,
            "__module__": __name__,
            "__doc__": f"{original.__name__} as an nn.ModuleList of nn.Linear experts (layerswap).",
        }
        base = _OWN_CLASSES.get(original.__name__) or (
            LinearPostNormExperts if flags is not None and flags.has_post_expert_norm else LinearExperts
        )
        forward = _forward_named_as(original) if base is LinearExperts else None
        if forward is not None:
            attributes["forward"] = forward
        if forward is _dense_forward:
            attributes["_layerswap_expert_parallel_refusal"] = (
                "its experts see every token, already weighted (dense experts), not routes"
            )
        return type(f"Linear{original.__name__}", (base,), attributes)

    return build


def _forward_named_as(original: type[nn.Module]) -> Callable[..., torch.Tensor] | None:
    """LinearExperts.forward under the stock forward's argument names, where they differ (gpt_oss names them
    `router_indices` and `routing_weights`), so calls by keyword keep working; None where they are the same."""
    signature = inspect.signature(original.forward)
    if list(signature.parameters)[1:4] == list(inspect.signature(LinearExperts.forward).parameters)[1:4]:
        return None
    if list(signature.parameters)[1:] == ["hidden_states"]:
        return _dense_forward

    def forward(self: LinearExperts, *args: Any, **kwargs: Any) -> torch.Tensor:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        hidden_states, top_k_index, top_k_weights = list(bound.arguments.values())[1:4]
        return LinearExperts.forward(self, hidden_states, top_k_index, top_k_weights)

    forward.__signature__ = signature  # type: ignore[attr-defined]
    return forward


def _dense_forward(self: LinearExperts, hidden_states: torch.Tensor) -> torch.Tensor:
    """Experts that see every token, already scaled by its routing score (llama4's): `hidden_states` is
    [E * T, H], expert e's tokens the e-th block of T rows, and so is the output."""
    self._check_experts_implementation()
    blocks = hidden_states.view(self.num_experts, -1, hidden_states.shape[-1])
    return torch.cat([expert(block) for expert, block in zip(self, blocks, strict=True)]).view(
        -1, self.hidden_dim
    )


class LinearDbrxExperts(LinearExperts):
    """dbrx's DbrxExperts, whose DbrxExpertGLU holds every expert's gate (w1), up (v1) and transposed down (w2)
    projection stacked as [E * I, H] (the family row's tensors say so), and whose forward takes and returns
    [B, S, H]."""

    _layerswap_expert_parallel_refusal = (
        "dbrx's experts take [B, S, H] inputs, not the dispatch's routed rows"
    )

    @classmethod
    def _read_stock(cls, reference: nn.Module) -> tuple[int, int, int, ExpertsFlags, Any]:
        return (
            reference.num_experts,
            reference.hidden_size,
            reference.ffn_hidden_size,
            ExpertsFlags(),
            reference.mlp.activation_fn,
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        flat = hidden_states.reshape(-1, self.hidden_dim)
        output = super().forward(flat, top_k_index, top_k_weights)
        return output.view(hidden_states.shape[0], -1, self.hidden_dim)


class LinearParallelExperts(LinearExperts):
    """jetmoe's JetMoeParallelExperts: one projection of every expert stacked as `weight [E, out, in]`, called with
    the routed rows already grouped by expert (`forward(inputs, expert_size)`, one count per expert). Its MoE MLP
    holds two (input_linear, gate and up joined; output_linear) and its mixture-of-attention two more (the query and
    output projections of each attention expert): each becomes one nn.Linear per expert, named by its index."""

    def __init__(self, num_experts: int, input_size: int, output_size: int) -> None:
        nn.ModuleList.__init__(
            self, (nn.Linear(input_size, output_size, bias=False) for _ in range(num_experts))
        )
        self.num_experts = num_experts
        self.input_size = input_size
        self.output_size = output_size
        self._stock_shapes = {"weight": (num_experts, output_size, input_size)}

    _layerswap_calibration_refusal = (
        "jetmoe's JetMoeParallelExperts get rows already grouped by expert, without the tokens they came from, so "
        "the tokens an expert did not get cannot be told apart"
    )
    _layerswap_expert_parallel_refusal = "jetmoe's experts get rows already grouped by expert, not routes"

    # The family's _init_weights initialises `weight` (each nn.Linear gets the same normal init on its own).
    weight = property(lambda self: self._stand_in("weight"))

    @classmethod
    def _layerswap_tp_plan(cls, owner: str, leaf: str, style: str) -> dict[str, str] | None:
        return None  # jetmoe has no tensor-parallel plan to rewrite

    def forward(self, inputs: torch.Tensor, expert_size: list[int]) -> torch.Tensor:
        if self._all_experts_chunk_size() is not None:
            _warn_uncalibrated_parallel_experts()
        groups = inputs.split(expert_size, dim=0)
        # Experts that got no rows are skipped: quantized layers (bitsandbytes' CPU 4-bit) fail on empty inputs.
        outputs = [expert(group) for expert, group in zip(self, groups, strict=True) if len(group)]
        return torch.cat(outputs, dim=0) if outputs else inputs.new_zeros(0, self.output_size)


_warned_parallel_experts = False


def _warn_uncalibrated_parallel_experts() -> None:
    global _warned_parallel_experts
    if not _warned_parallel_experts:
        _warned_parallel_experts = True
        warnings.warn(
            "A calibration pipeline asks every expert to see every token (llm-compressor's "
            f"moe_calibrate_all_experts), but {LinearParallelExperts._layerswap_calibration_refusal}: jetmoe's "
            "experts see only their routed rows. Calibrate with enough tokens for every expert, and check each "
            "expert's statistics.",
            LayerswapWarning,
            stacklevel=3,
        )


class _UnusedGateUp(nn.Module):
    """An identity expert's gate and up rows, which the stock gate_up_proj holds for every expert and the identity
    experts never use: kept so checkpoints load and save back whole."""

    def __init__(self, hidden_size: int, intermediate_size: int, names: ExpertNames) -> None:
        super().__init__()
        self.add_module(names.gate, nn.Linear(hidden_size, intermediate_size, bias=False))
        self.add_module(names.up, nn.Linear(hidden_size, intermediate_size, bias=False))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            "an identity expert computes nothing: LinearLongcatFlashExperts passes its rows through"
        )


class LinearLongcatFlashExperts(LinearExperts):
    """longcat_flash's LongcatFlashExperts: N real experts, then Z identity (zero-compute) experts whose routed rows
    pass through unchanged, weighted. The stock gate_up_proj stacks N + Z experts (the identity experts' rows are
    never used), down_proj the N real ones."""

    _layerswap_expert_parallel_refusal = "longcat_flash's identity experts are counted with its real ones"

    @classmethod
    def _read_stock(cls, reference: nn.Module) -> tuple[int, int, int, ExpertsFlags, Any]:
        if reference.gate_up_proj is None:
            raise UnsupportedTransformersError(
                f"{type(reference).__name__} with n_routed_experts=0 has only identity experts: nothing to "
                "quantize, so load it without the bundle."
            )
        return (
            reference.num_routed_experts,
            reference.hidden_size,
            reference.intermediate_size,
            ExpertsFlags(),
            reference.act_fn,
        )

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.num_identity_experts = self._stock_shapes["gate_up_proj"][0] - self.num_experts
        for _ in range(self.num_identity_experts):
            self.append(_UnusedGateUp(self.hidden_dim, self.intermediate_dim, self.expert_names))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        real = top_k_index < self.num_experts
        # Index num_experts is the "not computed here" index the real experts' forward skips.
        output = super().forward(hidden_states, top_k_index.where(real, self.num_experts), top_k_weights)
        identity_weights = top_k_weights.masked_fill(real, 0).sum(dim=-1, keepdim=True)
        return output + (hidden_states * identity_weights).to(output.dtype)


class LinearPostNormExperts(LinearExperts):
    """Experts whose outputs each go through one shared norm before their routing weight (muse_spark's
    `post_expert_norm`, declared `has_post_expert_norm=True`): the norm stays a child of the experts module, under
    its stock name, and every expert applies it. Iterating or measuring the module sees the experts alone."""

    def _adopt_from_stock(self, reference: nn.Module) -> None:
        stock_norm = reference.post_expert_norm
        try:
            norm = type(stock_norm)(self.hidden_dim, eps=stock_norm.eps)
        except (TypeError, AttributeError) as error:
            raise UnsupportedTransformersError(
                f"{self._layerswap_original.__name__}.post_expert_norm is a {type(stock_norm).__name__}, which "
                f"LinearPostNormExperts cannot rebuild as type(norm)(hidden_size, eps=...): {error}. Please report it."
            ) from error
        self.add_module("post_expert_norm", norm)
        for expert in self:
            object.__setattr__(expert, "post_norm", norm)

    def __iter__(self):  # the experts, not the norm
        return (module for name, module in self.named_children() if name.isdigit())

    def __len__(self) -> int:
        return sum(name.isdigit() for name, _ in self.named_children())


# Experts classes with a structure of their own, by stock class name.
_OWN_CLASSES: dict[str, type[LinearExperts]] = {
    "DbrxExperts": LinearDbrxExperts,
    "JetMoeParallelExperts": LinearParallelExperts,
    "LongcatFlashExperts": LinearLongcatFlashExperts,
}
