import os
import random

import pytest
import torch

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault(
    "LAYERSWAP_CPU_CALIBRATION", "0"
)  # no timing runs, no ~/.cache writes (tests/kernels opts in)

from transformers.utils import logging

import layerswap
from _support.global_state import comparable, describe_difference, global_state, leaked_recorders
from layerswap import registry as _registry

logging.set_verbosity_error()


@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws the same random numbers whatever ran before it (and alone or in the whole suite), so a
    tolerance that a rare draw would exceed fails every run, not one run in twenty."""
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _leaves_global_state_as_found():
    """Every test must leave transformers' global state as it found it; a leak fails the test that leaked."""
    before = global_state()
    yield
    leaked = layerswap.enabled_bundles()
    _registry.disable_all()
    after = global_state()
    assert not leaked, f"test left bundles enabled: {leaked}"
    assert not leaked_recorders(after), (
        f"layerswap classes left in output recorders: {leaked_recorders(after)}"
    )
    after = comparable(before, after)
    assert before == after, f"test changed global state: {describe_difference(before, after)}"
