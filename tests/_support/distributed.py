"""Run test code on two CPU ranks (gloo), each a spawned process, with a hard time limit.

Spawned, not forked: a fork of a process whose OpenMP pool has run can hang in the child. Each rank imports torch,
transformers and layerswap afresh (a few seconds), so a test module starts one world for all its loads
(`run_on_ranks(load_on_ranks, jobs)`) rather than one per case.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

WORLD_SIZE = 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def distributed_available() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


def run_on_ranks(worker: Callable[..., None], *args: Any, timeout_s: float = 240.0) -> None:
    """`worker(*args)` on WORLD_SIZE spawned ranks that have joined one gloo process group. Raises the first rank's
    error (with its traceback), or TimeoutError naming the limit once `timeout_s` has passed (every rank is then
    killed)."""
    import torch.multiprocessing as mp

    context = mp.start_processes(
        _joined,
        args=(free_port(), worker, args),
        nprocs=WORLD_SIZE,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{WORLD_SIZE} ranks running {worker.__name__} did not end in {timeout_s:.0f} s"
                )
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def _joined(rank: int, port: int, worker: Callable[..., None], args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
    )
    # One thread per rank: two ranks share the CI box's two cores.
    torch.set_num_threads(1)
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=120)
    )
    try:
        worker(*args)
    finally:
        torch.distributed.destroy_process_group()


@dataclass(frozen=True)
class Load:
    """One sharded load: `model_type` from `checkpoint` under `bundles`, with `distributed` (from_pretrained's
    parallelism arguments); its logits for `input_ids` are saved as `<name>.pt` in the output folder, and with
    `save`, the sharded model saves itself to `<name>-saved`; `<name>.json` says which classes were swapped in,
    which parameters are sharded, with their local shapes, and what each rank holds of the experts. A load that
    raises saves the error's text as `<name>.error` instead (rank 0's)."""

    name: str
    model_type: str
    checkpoint: str
    bundles: tuple[str, ...] = ()
    distributed: tuple[tuple[str, Any], ...] = (("tp_plan", "auto"),)
    save: bool = False


def load_on_ranks(loads: list[Load], input_ids: torch.Tensor, output: str) -> None:
    import layerswap
    from layerswap.testing.tiny import auto_class, text_logits

    rank = torch.distributed.get_rank()
    folder = Path(output)
    for load in loads:
        try:
            with layerswap.use_bundle(*load.bundles) if load.bundles else contextlib.nullcontext():
                model = auto_class(load.model_type).from_pretrained(load.checkpoint, **dict(load.distributed))
                with torch.no_grad():
                    logits = text_logits(model.eval(), input_ids)
                if load.save:
                    model.save_pretrained(folder / f"{load.name}-saved")
        except Exception as error:  # recorded for the test to assert on; every rank meets the same error
            if rank == 0:
                (folder / f"{load.name}.error").write_text(f"{type(error).__name__}: {error}")
            continue
        held = [None] * WORLD_SIZE
        torch.distributed.all_gather_object(held, _experts_held(model))
        if rank == 0:
            torch.save(logits, folder / f"{load.name}.pt")
            (folder / f"{load.name}.json").write_text(
                json.dumps({**_layout(model), "experts_per_rank": held})
            )
        torch.distributed.barrier()


def _layout(model: torch.nn.Module) -> dict[str, Any]:
    """What the load built: the swapped-in classes, and the parameters sharded across the ranks (DTensors) with
    their local shapes."""
    from torch.distributed.tensor import DTensor

    return {
        "swapped": sorted({type(m).__name__ for m in model.modules() if hasattr(m, "_layerswap_original")}),
        "sharded": {
            name: list(p.to_local().shape) for name, p in model.named_parameters() if isinstance(p, DTensor)
        },
    }


def _experts_held(model: torch.nn.Module) -> dict[str, Any]:
    """What this rank holds of the experts: the number of expert parameter elements in memory here (a DTensor's
    local shard), and the indices of the per-expert modules with weights in the first layer (empty for stacked 3D
    experts)."""
    from torch.distributed.tensor import DTensor

    elements = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel()
        for name, p in model.named_parameters()
        if ".experts." in name
    )
    first_layer = "model.layers.0.mlp.experts."
    indices = {
        int(name[len(first_layer) :].split(".")[0])
        for name, _ in model.named_parameters()
        if name.startswith(first_layer) and name[len(first_layer) :].split(".")[0].isdigit()
    }
    return {"elements": elements, "first_layer_experts": sorted(indices)}


def train_step_on_ranks(
    model_type: str,
    checkpoint: str,
    bundles: tuple[str, ...],
    routing: list[torch.Tensor],
    input_ids: torch.Tensor,
    output: str,
    lora: tuple[str, ...] | None = None,
) -> None:
    """One training step of the model sharded by FSDP2 (`distributed_config={"fsdp_size": 2}`), every rank on the
    same batch, with `routing` replayed (and with `lora`, LoRA adapters on those module names added after
    sharding, `with_lora`): rank 0 saves the loss and every parameter's full gradient as
    `train.pt`; every rank saves the routing its routers followed as `routing-<rank>.pt`."""
    from torch.distributed.tensor import DTensor

    import layerswap
    from layerswap.testing.tiny import auto_class

    rank = torch.distributed.get_rank()
    with layerswap.use_bundle(*bundles):
        model = auto_class(model_type).from_pretrained(
            checkpoint, distributed_config={"fsdp_size": WORLD_SIZE}
        )
        sharded = sorted(name for name, p in model.named_parameters() if isinstance(p, DTensor))
        if lora is not None:
            model = with_lora(model, lora)
        with layerswap.replay_routing(model, routing), layerswap.record_routing(model) as followed:
            loss = model(input_ids, labels=input_ids).loss
        loss.backward()
    gradients = {}
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            grad = parameter.grad
            gradients[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    torch.save([t.cpu() for t in followed.selected_experts], Path(output) / f"routing-{rank}.pt")
    if rank == 0:
        torch.save(
            {"loss": loss.detach(), "gradients": gradients, "sharded": sharded}, Path(output) / "train.pt"
        )


def with_lora(model: torch.nn.Module, target_modules: tuple[str, ...]) -> torch.nn.Module:
    """`model` with LoRA adapters (rank 4, seeded, lora_B non-zero so they change the output) on `target_modules`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(target_modules)))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.02)
    return model


@dataclass(frozen=True)
class Save:
    """A save of a sharded model: `model_type` from `checkpoint` under `bundles`, loaded with `distributed`, saved by
    every rank into `target` with `failure` made to happen on `rank` (see `_failing`; None: nothing fails). Each rank
    writes the error it raised, with its notes, as `<name>.rank<r>.error` in the output folder."""

    name: str
    model_type: str
    checkpoint: str
    bundles: tuple[str, ...]
    distributed: tuple[tuple[str, Any], ...]
    target: str
    failure: str | None = None
    rank: int = 0
    max_shard_size: str = "50GB"


def saves_on_ranks(saves: list[Save], output: str) -> None:
    import layerswap
    from layerswap.testing.tiny import auto_class

    rank = torch.distributed.get_rank()
    for save in saves:
        with layerswap.use_bundle(*save.bundles):
            model = auto_class(save.model_type).from_pretrained(save.checkpoint, **dict(save.distributed))
            with _failing(save.failure if rank == save.rank else None):
                try:
                    model.save_pretrained(save.target, max_shard_size=save.max_shard_size)
                except Exception as error:  # recorded for the test to assert on
                    notes = "".join(f"\nnote: {note}" for note in getattr(error, "__notes__", ()))
                    text = f"{type(error).__name__}: {error}{notes}"
                    (Path(output) / f"{save.name}.rank{rank}.error").write_text(text)
        torch.distributed.barrier()


@contextlib.contextmanager
def _failing(failure: str | None):
    """`failure` made to happen on this rank during a save: "convert" (transformers' reverse of the weight
    conversions raises, once every tensor was gathered), "write" (writing the second safetensors file raises, after
    the first was written), "gather" (handing this rank's experts to the saving rank raises)."""
    from unittest import mock

    from transformers import modeling_utils

    if failure is None:
        yield
        return
    if failure == "convert":
        patch = mock.patch.object(
            modeling_utils,
            "revert_weight_conversion",
            side_effect=RuntimeError("injected: a conversion failed"),
        )
    elif failure == "write":
        write = modeling_utils.safe_save_file
        calls = []

        def write_once(*args: Any, **kwargs: Any) -> Any:
            calls.append(args[1])
            if len(calls) > 1:
                raise OSError("injected: no space left on device")
            return write(*args, **kwargs)

        patch = mock.patch.object(modeling_utils, "safe_save_file", write_once)
    elif failure == "gather":
        from layerswap._hf import expert_parallel

        patch = mock.patch.object(
            expert_parallel, "held_tensors", side_effect=RuntimeError("injected: gathering failed")
        )
    else:
        raise ValueError(f"unknown failure {failure!r}")
    with patch:
        yield
