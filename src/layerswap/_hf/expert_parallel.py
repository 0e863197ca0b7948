"""Expert parallelism for swapped experts that split themselves by expert ('-quant's LinearExperts).

transformers' expert-parallel plan splits stacked 3D experts (`gate_up_proj [E, 2I, H]`, `grouped_gemm`) along the
experts axis and installs a dispatch on the experts module (`ep_dispatch_experts`) that hands each rank's experts
only their routes, with local expert ids (`num_experts` read from the module is the local count), then sums the
ranks' partial outputs. LinearExperts holds one nn.Linear MLP per expert, which no stock style splits, so:

- `shard_experts_on_dispatch` (an installer) wraps `EpDispatchExpertsParallel.install_forward`: a module with
  `_layerswap_shard_experts(rank, size)` first keeps only the contiguous block of experts this rank owns (as the
  stock style does), before any weight is loaded; the dispatch then runs as for stock experts.
- Loading, a per-expert checkpoint's tensors for experts other ranks hold are not unexpected here (transformers
  files pipeline stages' keys the same way): `forget_keys_held_elsewhere`, called by `_hf.loading`.
- Saving, `DistributedMixin.gather_sharded_state_dict_for_save` is wrapped (`watch`, at import: a model loaded
  inside `use_bundle` is often saved after it) to gather each expert's tensors from the rank that holds it, so the
  saving rank writes every expert. A rank that fails to hand over its experts fails the save on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ShardedSaveError
from .compat import INTERNALS, lacks
from .journal import Journal
from .parallel import SharedWrapper

_EP_DISPATCH = "EpDispatchExpertsParallel.install_forward"
_GATHER = "DistributedMixin.gather_sharded_state_dict_for_save"


def _available(attribute: str) -> bool:
    internal = next(i for i in INTERNALS if i.attribute == attribute)
    return lacks(internal) is None


def held_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) for every experts module that holds only some experts on this rank."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if getattr(module, "_layerswap_held_experts", None) is not None
    ]


# --- splitting the experts when the dispatch is installed -----------------------------------------------------


def _dispatch_style() -> type | None:
    # Only where a save can gather the experts back: without the gather, a split model would save some experts.
    if not (_available(_EP_DISPATCH) and _available(_GATHER)):
        return None
    from transformers.distributed.expert_parallel import EpDispatchExpertsParallel

    return EpDispatchExpertsParallel


def _splitting_first(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def install_forward(self: Any, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        shard = getattr(module, "_layerswap_shard_experts", None)
        if shard is not None:
            mesh = kwargs["ep_mesh"] if "ep_mesh" in kwargs else args[0]
            shard(mesh.get_local_rank(), mesh.size())
        return original(self, module, *args, **kwargs)

    return install_forward


_dispatch_wrapper = SharedWrapper(_dispatch_style, "install_forward", _splitting_first)


def shard_experts_on_dispatch(options: Any) -> Callable[[], None]:
    """Installer ('-quant'): experts modules that can split themselves by expert do so when transformers installs
    the expert-parallel dispatch on them. Nothing where the installed transformers has no such dispatch (they
    then stay whole on every rank, and the dispatch runs them all on the first)."""
    return _dispatch_wrapper.install()


# --- loading -------------------------------------------------------------------------------------------------


def forget_keys_held_elsewhere(swapped: list[tuple[str, nn.Module]], loading_info: Any) -> None:
    """Drop from the load's unexpected keys the checkpoint tensors of experts other ranks hold: they are loaded
    there, not missing here."""
    unexpected = getattr(loading_info, "unexpected_keys", None)
    if not unexpected:
        return
    elsewhere = tuple(
        f"{name}.{index}."
        for name, module in swapped
        if (held := getattr(module, "_layerswap_held_experts", None)) is not None
        for index in range(module.num_global_experts)
        if index not in held
    )
    if elsewhere:
        unexpected.difference_update([key for key in unexpected if key.startswith(elsewhere)])


# --- saving --------------------------------------------------------------------------------------------------


def held_tensors(state_dict: dict[str, Any], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """This rank's experts' tensors in `state_dict`, on the CPU, to hand to the saving rank."""
    return {
        key: value.detach().cpu()
        for key, value in state_dict.items()
        if key.startswith(prefixes) and isinstance(value, torch.Tensor)
    }


def gather_held_experts(model: nn.Module, state_dict: dict[str, Any], keep: bool) -> dict[str, Any]:
    """`state_dict` with every rank's experts added, on rank 0 (the rank transformers saves from) where it `keep`s
    them; every other rank gets its `state_dict` back as it was. Every rank must call it. Each rank first says
    whether it could take its tensors, so that a rank that failed makes every rank raise, rather than leave the
    others waiting in the gather."""
    modules = held_experts_modules(model)
    if not modules:
        return state_dict
    import torch.distributed as dist

    prefixes = tuple(f"{name}." for name, _ in modules)
    tensors: dict[str, torch.Tensor] = {}
    error: BaseException | None = None
    try:
        tensors = held_tensors(state_dict, prefixes)
    except Exception as caught:  # reported to every rank below, then raised here
        error = caught
    raise_if_any_rank_failed(error, "handing its experts to the saving rank")
    rank = dist.get_rank()
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(tensors, gathered, dst=0)
    if rank != 0 or not keep:
        return state_dict
    merged = dict(state_dict)
    for part in gathered or ():
        merged.update(part)
    return merged


def raise_if_any_rank_failed(error: BaseException | None, doing: str) -> None:
    """Every rank tells every other whether `doing` failed on it; then each raises if any did: its own error, or
    ShardedSaveError naming the rank that failed and its error. Every rank must call it."""
    import torch.distributed as dist

    report = None if error is None else f"{type(error).__name__}: {error}"
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    failed = [(rank, text) for rank, text in enumerate(reports) if text is not None]
    if not failed:
        return
    if error is not None:
        raise error
    rank, text = failed[0]
    raise ShardedSaveError(f"rank {rank} failed {doing}: {text}")


def _gathering_held_experts(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def gather_sharded_state_dict_for_save(
        self: Any, model_to_save: nn.Module, state_dict: dict, distributed_config: Any, **kwargs: Any
    ) -> dict:
        if distributed_config is not None and getattr(distributed_config, "ep_size", 1) > 1:
            keep = kwargs.get("save_on_this_rank", True)
            state_dict = gather_held_experts(model_to_save, state_dict, keep)
        return original(self, model_to_save, state_dict, distributed_config, **kwargs)

    return gather_sharded_state_dict_for_save


_journal = Journal()


def watch() -> None:
    """Install the gathering save (layerswap's import does); `unwatch` puts transformers back."""
    if _journal or not _available(_GATHER):
        return
    from transformers.distributed.mixin import DistributedMixin

    original = vars(DistributedMixin)["gather_sharded_state_dict_for_save"]
    _journal.set_attribute(
        DistributedMixin, "gather_sharded_state_dict_for_save", _gathering_held_experts(original)
    )


def unwatch() -> None:
    _journal.undo()
