"""FusedQKVAttention: one `qkv_proj` GEMM (q rows, then k, then v) in place of q_proj / k_proj / v_proj.

The per-family replacement subclasses the stock attention class, so every `isinstance(module, StockAttention)`
keeps matching (output recorders after the bundle is disabled, `_init_weights` branches such as attention sinks),
and it reuses the stock forward rather than re-implementing it:

- `__init__` runs the stock `__init__` with its own arguments, intercepts the three nn.Linear it assigns to
  q_proj / k_proj / v_proj, and keeps one nn.Linear whose weight (and bias, where the family has one) is their
  concatenation. Sizes, GQA widths and biases come from what the stock code built for this very layer, so per-layer
  head counts, gated queries and odd value widths need nothing family-specific.
- `forward` projects once (`project_qkv`) and calls the stock forward, whose `self.q_proj(hidden_states)` /
  `k_proj` / `v_proj` calls return the three parts. Norms (per-head or full-width), rotary, clipping, the cache
  (`cache=` and the deprecated `past_key_values=`), sliding windows, sinks and the eager / sdpa / flash dispatch
  through ALL_ATTENTION_FUNCTIONS are the stock code, and so is the return contract.

On CPU the projection is one GEMM only where that measured faster than stock's three (one thread, weights
streamed from memory, Llama-3.2-1B and Qwen3-30B-A3B shapes): in bf16 up to 256 tokens (batch * length), 0.90-0.96
of stock's time up to 64 tokens, while at 512 one GEMM ran 1.02-1.08x for the Qwen3 shape; in fp32 up to 2 tokens
(0.95-0.98), as at 4-8 tokens one GEMM ran 1.01-1.07x (MKL changes kernels there). The one GEMM is split into
views of its last dim that the stock `.view(..., -1, head_dim).transpose(1, 2)` takes without copying. Otherwise a
plain nn.Linear runs three GEMMs on row blocks of the fused weight (views, no copies): the stock kernels at stock
speed. Other devices, and quantized or hooked `qkv_proj` modules, always take the one GEMM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..._hf.compat import TRANSFORMERS_VERSION
from ..._hf.parallel import row_shards
from ...bundle import BundleOptions
from ...errors import FusedQKVParallelismError, UnsupportedTransformersError
from ...quantized import is_quantized_linear
from .conversion import FusedQKVConverter

PROJECTIONS = ("q_proj", "k_proj", "v_proj")
_INTERCEPTED = "_layerswap_intercepted"  # the stock q/k/v nn.Linear, collected while the stock __init__ runs
_CURRENT = "_layerswap_current_qkv"  # (hidden_states, [q, k, v]) while the stock forward runs
# Tokens up to which one fused GEMM beat three on CPU (see the module docstring), by dtype; bf16 / fp16 otherwise.
_CPU_FUSED_GEMM_MAX_ROWS = {torch.float32: 2}
_CPU_FUSED_GEMM_MAX_ROWS_HALF = 256
# Tensor-parallel styles that shard a projection's weight but hand every rank the whole output.
_GATHERED_OUTPUT_STYLES = frozenset({"colwise_gather_output", "colwise_rep"})


class FusedQKVAttention(nn.Module):
    """Base placed before the stock attention class in the bases of each family's replacement.

    Per-family subclasses (built by `fused_qkv_adapter`) set `_layerswap_original` and a `forward` that wraps
    the stock one. `qkv_sizes` are the (q, k, v) output widths, in the order of the rows of `qkv_proj`.
    """

    _layerswap_original: type[nn.Module]
    _layerswap_strict = True  # a checkpoint lacking qkv weights is an error, never a random init
    qkv_sizes: tuple[int, int, int]
    # Tokens (batch * length) up to which q, k and v come from one GEMM on CPU; None: _CPU_FUSED_GEMM_MAX_ROWS.
    fused_gemm_max_rows: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        intercepted: dict[str, nn.Module] = {}
        self.__dict__[_INTERCEPTED] = intercepted
        try:
            super().__init__(*args, **kwargs)
        finally:
            del self.__dict__[_INTERCEPTED]
        self.qkv_proj = _fuse(intercepted, self._layerswap_original)
        self.qkv_sizes = tuple(intercepted[name].out_features for name in PROJECTIONS)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in PROJECTIONS:
            intercepted = self.__dict__.get(_INTERCEPTED)
            if intercepted is None:
                raise AttributeError(
                    f"{type(self).__name__} computes q, k and v with one fused `qkv_proj` and has no separate "
                    f"{name} to set. Replace `qkv_proj` instead, or disable the '-fused_qkv' bundle."
                )
            intercepted[name] = value
            return
        super().__setattr__(name, value)

    # The stock forward calls `self.q_proj(hidden_states)` etc.; these hand it forward's q / k / v parts.
    @property
    def q_proj(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return functools.partial(self._projection, 0)

    @property
    def k_proj(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return functools.partial(self._projection, 1)

    @property
    def v_proj(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return functools.partial(self._projection, 2)

    def _projection(self, index: int, hidden_states: torch.Tensor) -> torch.Tensor:
        current = self.__dict__.get(_CURRENT)
        if current is not None and current[0] is hidden_states and current[1][index] is not None:
            # Handed over, not kept: the fused output lives no longer than stock's separate outputs would.
            part, current[1][index] = current[1][index], None
            return part
        # Called outside forward, on another tensor than forward's input, or twice: the same math, recomputed.
        return self.project_qkv(hidden_states)[index]

    def project_qkv(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of `hidden_states`, each `[..., width]` as the stock projections return them."""
        projection = self.qkv_proj
        if not self._one_gemm(hidden_states, projection):
            biases = projection.bias.split(self.qkv_sizes) if projection.bias is not None else (None,) * 3
            weights = projection.weight.split(self.qkv_sizes)
            return tuple(F.linear(hidden_states, w, b) for w, b in zip(weights, biases, strict=True))
        fused = projection(hidden_states)
        # Views of the last dim (stride 1), so the stock `.view(..., -1, head_dim).transpose(1, 2)` copies nothing.
        parts = fused.split(self._sizes_for(fused.shape[-1]), dim=-1)
        if fused.requires_grad:
            # Views share one version counter: a stock forward that edits one in place (olmoe's clip_qkv clamp_)
            # would invalidate another one saved for backward. Only autograd needs separate tensors.
            parts = tuple(part.clone() for part in parts)
        return parts

    def _one_gemm(self, hidden_states: torch.Tensor, projection: nn.Module) -> bool:
        if hidden_states.device.type != "cpu" or not _is_plain_linear(projection):
            return True
        limit = self.fused_gemm_max_rows
        if limit is None:
            limit = _CPU_FUSED_GEMM_MAX_ROWS.get(hidden_states.dtype, _CPU_FUSED_GEMM_MAX_ROWS_HALF)
        return hidden_states.numel() <= limit * projection.in_features

    def extra_repr(self) -> str:
        return f"replaces={self._layerswap_original.__name__}, qkv_sizes={self.qkv_sizes}"

    # --- what the loading hooks ask a swapped module (layerswap._hf) ---

    @classmethod
    def _layerswap_tp_plan(cls, owner: str, leaf: str, style: str) -> dict[str, str] | None:
        """The stock q/k/v entries become one `qkv_proj` entry in their style: `colwise` (each rank its own heads),
        or no entry where stock gathers the full q, k and v on every rank (olmoe's `colwise_gather_output`, for its
        full-width norms): an unsharded qkv_proj computes that same full output, with the whole weight on every
        rank. Another style is refused by _layerswap_check_tensor_parallel. The other entries stay."""
        if leaf not in PROJECTIONS:
            return None
        return {} if style in _GATHERED_OUTPUT_STYLES else {f"{owner}.qkv_proj": style}

    def _layerswap_check_tensor_parallel(self, name: str, plan: dict[str, str], tp_size: int) -> None:
        """Refuse, before any weight is loaded, a resolved plan (`plan`: its entries inside this module) that
        would not give each of the `tp_size` ranks whole heads of q, k and v.

        Sharded colwise, `qkv_proj` holds on each rank its own block of q heads, then k heads, then v heads (as
        vLLM's QKVParallelLinear does): transformers cuts each of the checkpoint's q_proj, k_proj and v_proj on
        read by qkv_proj's row placement, and ConcatenateQKV joins the three cuts. That needs the query and the
        key/value heads to divide by the ranks."""
        styles = {rule[len(name) + 1 :]: style for rule, style in plan.items()}
        fused = {leaf: style for leaf, style in styles.items() if leaf.split(".")[0] == "qkv_proj"}
        wrong = {leaf: style for leaf, style in fused.items() if style != "colwise"}
        model_type = self._layerswap_model_type()
        bundle = f"the '{model_type}-fused_qkv' (or '{model_type}-fast') bundle"
        if wrong:
            raise FusedQKVParallelismError(
                f"Tensor parallelism would shard {name}.qkv_proj as {sorted(set(wrong.values()))}: {bundle} fused "
                "q/k/v into one qkv_proj, which shards head-wise only as 'colwise' (each rank its own q, k and v "
                "heads). Use 'colwise' for q_proj/k_proj/v_proj in the plan, or disable the bundle for this run."
            )
        if not fused:
            return
        head_dim = self._layerswap_head_dim()
        heads = tuple(size // head_dim for size in self.qkv_sizes)
        uneven = any(size % head_dim for size in self.qkv_sizes) or any(count % tp_size for count in heads)
        if uneven:
            raise FusedQKVParallelismError(
                f"Tensor parallelism over {tp_size} ranks cannot give each rank whole heads of {name}: its fused "
                f"qkv_proj holds {heads[0]} query, {heads[1]} key and {heads[2]} value heads of {head_dim} "
                f"(widths {self.qkv_sizes}), and {tp_size} does not divide them all. Use a tensor-parallel size "
                f"that divides {heads[0]} and {heads[1]}, or disable {bundle} for this run."
            )

    def _layerswap_check_checkpoint_keys(self, name: str, keys: frozenset[str] | None) -> bool:
        """Asked after loading (keys None: whether it needs the checkpoint's keys at all): a checkpoint holding
        qkv_proj fused was cut on read into contiguous row blocks, which under tensor parallelism gives the first
        rank only query rows, not its own q, k and v heads (stock q/k/v checkpoints are cut one by one)."""
        shards = row_shards(self.qkv_proj.weight)
        if keys is None or shards == 1:
            return shards > 1
        # From `layers.` on: transformers may add or drop the base model's prefix on load.
        suffix = "layers." + name.split("layers.", 1)[1] if "layers." in name else name
        fused = sorted(k for k in keys if k.endswith(f"{suffix}.qkv_proj.weight"))
        if fused:
            raise FusedQKVParallelismError(
                f"The checkpoint holds {fused[0]} fused (saved with save_original_format=False), and tensor "
                f"parallelism over {shards} ranks cut it into contiguous row blocks: the first rank got only query "
                "rows, not its own query, key and value heads. Save the checkpoint in the stock "
                "q_proj/k_proj/v_proj layout first (load it in one process under the bundle and call "
                "save_pretrained(path)), then load that with tensor parallelism."
            )
        return True

    def _layerswap_head_dim(self) -> int:
        head_dim = getattr(self, "head_dim", None)
        if isinstance(head_dim, int) and head_dim > 0:
            return head_dim
        config = getattr(self, "config", None)
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def _layerswap_model_type(self) -> str:
        return getattr(getattr(self, "config", None), "model_type", None) or "<model_type>"

    def _sizes_for(self, width: int) -> tuple[int, int, int]:
        """The (q, k, v) widths of a `width`-wide qkv_proj output: `qkv_sizes`, or under tensor parallelism this
        rank's share of each (whole heads, checked when the plan was resolved)."""
        total = sum(self.qkv_sizes)
        if width == total:
            return self.qkv_sizes
        shards = total // width
        return tuple(size // shards for size in self.qkv_sizes)

    def _layerswap_conversions_kept_when_quantized(self) -> tuple[type, ...]:
        """A quantized qkv_proj cannot be split on save: it saves fused, as loaded."""
        return (FusedQKVConverter,) if is_quantized_linear(self.qkv_proj) else ()


def _fuse(intercepted: dict[str, nn.Module], original: type[nn.Module]) -> nn.Linear:
    """One nn.Linear holding the stock q, k and v projections' rows, on their device and in their dtype."""
    linears = [intercepted.get(name) for name in PROJECTIONS]
    usable = all(type(module) is nn.Linear for module in linears) and (
        len({module.in_features for module in linears}) == 1
        and len({module.bias is None for module in linears}) == 1
        and len({(module.weight.device, module.weight.dtype) for module in linears}) == 1
    )
    if not usable:
        details = {
            name: (type(m).__name__, getattr(m, "in_features", None), getattr(m, "bias", None) is not None)
            for name, m in zip(PROJECTIONS, linears, strict=True)
        }
        raise UnsupportedTransformersError(
            f"{original.__module__}.{original.__qualname__} in transformers {TRANSFORMERS_VERSION} does not build "
            f"three plain nn.Linear q_proj / k_proj / v_proj with one input width and the same bias setting "
            f"(found {details}), so FusedQKVAttention cannot fuse them. "
            "Disable this family's '-fused_qkv' bundle and please report it."
        )
    in_features = linears[0].in_features
    out_features = sum(module.out_features for module in linears)
    has_bias = linears[0].bias is not None
    # Built on meta and given the concatenated stock tensors: no second allocation or init, and a model built
    # outside from_pretrained starts from the stock initial values.
    fused = nn.Linear(in_features, out_features, bias=has_bias, device="meta")
    fused.weight = nn.Parameter(torch.cat([module.weight for module in linears]))
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([module.bias for module in linears]))
    return fused


def _is_plain_linear(linear: nn.Module) -> bool:
    """An unquantized nn.Linear with no hooks (accelerate's offload hook replaces `forward` on the instance), so
    computing with its weight directly skips nothing that calling it would do."""
    return (
        type(linear) is nn.Linear
        and not linear._forward_hooks
        and not linear._forward_pre_hooks
        and "forward" not in linear.__dict__
    )


def _fused_forward(stock_forward: Callable[..., Any]) -> Callable[..., Any]:
    # functools.wraps keeps the stock signature visible (inspect follows __wrapped__) for the contract check.
    @functools.wraps(stock_forward)
    def forward(self: FusedQKVAttention, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.__dict__[_CURRENT] = (hidden_states, list(self.project_qkv(hidden_states)))
        try:
            return stock_forward(self, hidden_states, *args, **kwargs)
        finally:
            self.__dict__.pop(_CURRENT, None)

    return forward


def fused_qkv_adapter(original: type[nn.Module], options: BundleOptions) -> type[nn.Module]:
    """The AdapterFactory of the '-fused_qkv' bundles: a subclass of the stock attention class `original`."""
    return type(
        f"FusedQKV{original.__name__}",
        (FusedQKVAttention, original),
        {
            "_layerswap_original": original,
            "forward": _fused_forward(original.forward),
            "__module__": __name__,
            "__doc__": f"{original.__name__} with one fused qkv_proj in place of q_proj / k_proj / v_proj (layerswap).",
        },
    )
