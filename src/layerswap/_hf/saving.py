"""All-or-nothing saves of sharded swapped models.

`save_pretrained` on a sharded model runs on every rank: each gathers its shards to the saving rank (rank 0), which
writes config.json first, then the weights. A failure on any rank part-way (gathering, converting or writing a
tensor) would leave the target folder holding a config and some of the weights, or a previous checkpoint's weights
with the new config: a checkpoint that a later `from_pretrained` loads, silently wrong, or not at all.

So, for a sharded model with swapped modules (tensor, expert or data parallelism over more than one rank), every
rank saves into one staging folder beside the target (`.<name>.layerswap-saving-*`, named by rank 0); then every
rank tells every other whether its part succeeded, and only if all did does rank 0 move the files into the target
(removing the weights files of an earlier save that this one does not write). The staging
folder goes in every case. On a failure the target is as it was, every rank raises: the rank that failed its own
error, the others ShardedSaveError naming that rank and its error. transformers' barrier at the end of the save
is skipped meanwhile: a rank that failed before it would leave the others waiting there, and the agreement above
is a barrier itself.

Saves that push to the Hub or write a torch distributed checkpoint (`distributed_checkpoint=True`) are left as
transformers makes them. The wrapper is installed when layerswap is imported (`watch`): a model loaded inside
`use_bundle` is often saved after it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch import nn
from transformers.modeling_utils import PreTrainedModel

from .active import swapped_modules
from .compat import INTERNALS, lacks
from .expert_parallel import raise_if_any_rank_failed
from .journal import Journal

_BARRIER = "barrier_after_gathered_checkpoint_save"
# Files written last: a reader that finds them finds the weights they describe.
_WRITTEN_LAST = ("config.json", "generation_config.json")
# A weights file: `model.safetensors`, a shard `model-00001-of-00003.safetensors`, an index
# `model.safetensors.index.json` (a variant's stem is `model.fp16`, an adapter's `adapter_model`).
_WEIGHTS = re.compile(r"(?P<stem>.+?)(?:-\d{5}-of-\d{5})?\.(?:safetensors|bin)(?:\.index\.json)?")


def _barrier_available() -> bool:
    internal = next(i for i in INTERNALS if i.attribute == f"DistributedMixin.{_BARRIER}")
    return lacks(internal) is None


def is_sharded_swapped(model: nn.Module) -> bool:
    """Whether `model` is split across ranks by transformers (over more than one process) and holds modules
    layerswap swapped in."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    if config is None:
        return False
    sizes = (getattr(config, name, 1) or 1 for name in ("tp_size", "ep_size", "dp_size"))
    return any(size > 1 for size in sizes) and bool(swapped_modules(model))


def make_all_or_nothing_save_pretrained(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_pretrained(self: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(self, save_directory, *args, **kwargs).arguments
        if (
            arguments.get("push_to_hub")
            or arguments.get("distributed_checkpoint")
            or os.path.isfile(save_directory)  # transformers logs the error and returns
            or not is_sharded_swapped(self)
        ):
            return original(self, save_directory, *args, **kwargs)
        saves = arguments.get("is_main_process", True)
        return _save_all_or_nothing(
            lambda staging: original(self, staging, *args, **kwargs), self, Path(save_directory), saves
        )

    return save_pretrained


def _save_all_or_nothing(save: Callable[[Path], Any], model: nn.Module, target: Path, saves: bool) -> None:
    import torch.distributed as dist

    staging = _staging_folder(target)
    try:
        error: BaseException | None = None
        try:
            with _without_final_barrier(model):
                save(staging)
        except Exception as caught:  # every rank hears of it below; then this rank raises it
            error = caught
        _raise_naming_the_target(error, f"saving into {staging.name}", target)
        if dist.get_rank() == 0 and saves:
            try:
                move_into_place(staging, target)
            except Exception as caught:
                error = caught
        _raise_naming_the_target(error, f"moving the saved files into {target}", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _raise_naming_the_target(error: BaseException | None, doing: str, target: Path) -> None:
    try:
        raise_if_any_rank_failed(error, doing)
    except BaseException as failure:
        failure.add_note(
            f"layerswap: the sharded save failed, so nothing was written to {target} (every rank saved into a "
            "staging folder beside it, now removed)."
        )
        raise


def _staging_folder(target: Path) -> Path:
    """A new empty folder beside `target` (on its file system, so files move by renaming), named by rank 0."""
    import torch.distributed as dist

    name = [None]
    if dist.get_rank() == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        name[0] = tempfile.mkdtemp(prefix=f".{target.name}.layerswap-saving-", dir=target.parent)
    dist.broadcast_object_list(name, src=0)
    return Path(name[0])


@contextlib.contextmanager
def _without_final_barrier(model: nn.Module) -> Iterator[None]:
    vars(model)[_BARRIER] = lambda distributed_config: None
    try:
        yield
    finally:
        vars(model).pop(_BARRIER, None)


def move_into_place(staging: Path, target: Path) -> None:
    """Move every file of `staging` into `target`, the configs last, after removing the weights files of an earlier
    save in `target` that this one does not write. Other files in `target` (a tokenizer, a README) stay."""
    target.mkdir(parents=True, exist_ok=True)
    written = sorted(os.listdir(staging), key=lambda name: name in _WRITTEN_LAST)
    for stale in stale_weights(target, written):
        (target / stale).unlink()
    for name in written:
        destination = target / name
        if destination.is_dir():
            shutil.rmtree(destination)
        os.replace(staging / name, destination)


def stale_weights(target: Path, written: list[str]) -> list[str]:
    """The weights files in `target` under the names being `written` (`model.safetensors`, its shards
    `model-00001-of-00003.safetensors` and their index) that the new save does not write. transformers' own save
    removes only stale shards, so a sharded save over a single-file one left the old `model.safetensors`, which
    loads first."""
    stems = {match["stem"] for name in written if (match := _WEIGHTS.fullmatch(name)) is not None}
    return sorted(
        name
        for name in os.listdir(target)
        if name not in written
        and (match := _WEIGHTS.fullmatch(name)) is not None
        and match["stem"] in stems
        and (target / name).is_file()
    )


_journal = Journal()


def watch() -> None:
    """Install the all-or-nothing save (layerswap's import does); `unwatch` puts transformers back."""
    if _journal or not _barrier_available():
        return
    save = vars(PreTrainedModel)["save_pretrained"]
    _journal.set_attribute(PreTrainedModel, "save_pretrained", make_all_or_nothing_save_pretrained(save))


def unwatch() -> None:
    _journal.undo()
