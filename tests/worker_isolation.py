"""Isolation of test processes: each gets its own var folder; each pytest-xdist worker also its own Redis server.

`make test` runs the suite in several worker processes (pytest-xdist, `--dist loadfile`). Areas
flush their Redis databases and start real Celery workers on a broker database, and runs claim
`var/runs/<id>` folders whose ids restart at 1 in every fresh test database; two workers sharing
one Redis server or one var folder would steal each other's tasks and folders. So, before any app
module reads its settings, a worker:

- starts a private `redis-server` on a free port (no persistence) and points
  `TURNSTILE_TEST_REDIS` and `REDIS_URL` at it; it is stopped when the worker exits;
- uses a private var folder (`TURNSTILE_VAR_DIR`) in which `models/` links to the checkout's
  model cache, while the sdist/venv cache and the harness CLIs stay shared
  (`TURNSTILE_CACHE_DIR`, `TURNSTILE_TOOLS_DIR`): their builders take a file lock per entry.

Outside xdist (plain `pytest`) the process keeps the default Redis at 127.0.0.1:6379 (tests use
its databases 10 and up, never a deployment's 0) but still gets a private var folder: run ids
restart at 1 in every test database, and a test claiming `var/runs/1` in the checkout's own var
folder would set a real run's folder aside as `1.stale-*`.
"""
from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # no app import here: settings must not be read before isolation


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_redis(workdir: Path) -> str:
    """Start a private redis-server; return its base URL (no database number).
    Raises RuntimeError if it does not answer PING within 10 s."""
    import redis

    port = _free_port()
    proc = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--databases", "16", "--maxmemory-policy", "noeviction"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    atexit.register(lambda: (proc.terminate(), proc.wait(10)))
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if client.ping():
                return f"redis://127.0.0.1:{port}"
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError(f"private redis-server for test worker did not answer on port {port}")


def isolate_test_process() -> Path:
    """Give this test process a private var folder, and a pytest-xdist worker its own Redis too
    (see the module docstring); returns the var folder.  Must run before `support` and any app
    module are imported."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    base = Path(tempfile.mkdtemp(prefix=f"turnstile-{worker or 'pytest'}-"))
    atexit.register(shutil.rmtree, base, True)
    if worker:
        url = _start_redis(base)
        os.environ["TURNSTILE_TEST_REDIS"] = url
        os.environ["REDIS_URL"] = f"{url}/10"
    var = base / "var"
    var.mkdir()
    project_var = ROOT / "var"
    (project_var / "models").mkdir(parents=True, exist_ok=True)
    (var / "models").symlink_to(project_var / "models")
    os.environ["TURNSTILE_VAR_DIR"] = str(var)
    os.environ.setdefault("TURNSTILE_CACHE_DIR", str(project_var / "cache"))
    os.environ.setdefault("TURNSTILE_TOOLS_DIR", str(project_var / "tools"))
    return var
