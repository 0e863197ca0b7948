"""Where layerswap keeps what it measured or built on this machine (CPU dispatch decisions, the CPU kernel)."""

from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE_DIR = "LAYERSWAP_CACHE_DIR"


def cache_dir() -> Path:
    """LAYERSWAP_CACHE_DIR, else $XDG_CACHE_HOME/layerswap, else ~/.cache/layerswap."""
    explicit = os.environ.get(ENV_CACHE_DIR)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "layerswap"
