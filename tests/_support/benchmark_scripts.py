"""Running the checkout's benchmark scripts as a user runs them (a subprocess per script), for the tests that
check them at their smallest sizes. Tests only run the scripts and read their CSVs; they import nothing of them."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_script(script: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`python benchmarks/<script> *args`, offline and without progress bars; asserts it succeeded (with
    `check`), showing the end of its stderr when it did not."""
    environment = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
    )
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))
