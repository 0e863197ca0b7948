import os

# No model hub here: a tool that would fetch a default calibration set or config must fail at once, not wait.
# Set before transformers and huggingface_hub are imported: they read it then.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from tiny_checkpoints import FAMILIES, save_tiny_checkpoint


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_checkpoint(request, tmp_path_factory):
    """(model type, path) of a tiny stock-layout checkpoint with a tokenizer."""
    model_type = request.param
    return model_type, save_tiny_checkpoint(model_type, tmp_path_factory.mktemp(model_type))


# --- measured figures, printed at the end ----------------------------------------------------------------------

MEASURED: dict[str, list[str]] = {}


@pytest.fixture(scope="session")
def measured() -> dict[str, list[str]]:
    """Figures the tests measure (section -> lines), printed after the run (docs/vllm.md and docs/quantizers.md quote them)."""
    return MEASURED


def pytest_terminal_summary(terminalreporter) -> None:
    for section, lines in MEASURED.items():
        terminalreporter.write_sep("-", section)
        for line in sorted(lines):
            terminalreporter.write_line(line)
