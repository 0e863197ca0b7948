"""Helpers to save tiny checkpoints and read them back as plain tensors."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def read_checkpoint(directory: str | Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def drop_keys(directory: str | Path, predicate) -> list[str]:
    """Rewrite the checkpoint without the keys `predicate` selects; returns them."""
    dropped = []
    for shard in sorted(Path(directory).glob("*.safetensors")):
        tensors = load_file(shard)
        kept = {k: v for k, v in tensors.items() if not predicate(k)}
        dropped += sorted(set(tensors) - set(kept))
        save_file(kept, shard, metadata={"format": "pt"})
    return dropped


def assert_state_dicts_identical(expected: torch.nn.Module, actual: torch.nn.Module) -> None:
    a, b = expected.state_dict(), actual.state_dict()
    assert set(a) == set(b), f"keys differ: {sorted(set(a) ^ set(b))[:6]}"
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ: {different[:6]}"


def checkpoint_factory(tmp_path_factory, overrides=lambda model_type: {}):
    """`get(model_type)`: a tiny stock checkpoint of that family, saved once per factory and reused."""
    from _support.tiny_models import tiny_model

    saved: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in saved:
            path = tmp_path_factory.mktemp(model_type)
            tiny_model(model_type, **overrides(model_type)).save_pretrained(path)
            saved[model_type] = path
        return saved[model_type]

    return get
