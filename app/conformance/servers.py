"""Server subprocesses the conformance checks start: the scripted engine and the gateway.

`Servers(harness, database_url, workdir)` is a context manager that starts the
scripted engine (`python -m app.conformance.scripted.check`) and the gateway
(gunicorn, `app.proxy:create_gateway_app()`) on free loopback ports, both bound
to one SQL database, each in its own process group with its log under
`workdir`; leaving the context kills them.  The pipeline check extends it with
the REST API and a Celery worker.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago; returns the port number."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 30.0) -> None:
    """Wait until `url` answers with a status below 500; returns None.

    Raises RuntimeError (with the tail of `log`) when `proc` exits first, or when
    `url` does not answer within `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited {proc.returncode}:\n{log.read_text(errors='replace')[-2000:]}")
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


class Servers:
    """The scripted engine and the gateway as subprocesses (own process groups; killed on exit).

    `harness` is a preset name or `auto` (the engine picks each episode's script
    from its run config).  After `__enter__`, `engine_url` and `gateway_url` name
    the two servers.  Entering raises RuntimeError when a server does not start
    (the ones already started are stopped first).
    """

    def __init__(self, harness: str, database_url: str, workdir: Path, max_model_len: int | None = None):
        self.harness, self.database_url, self.workdir = harness, database_url, workdir
        self.max_model_len = max_model_len
        self.procs: list[tuple[subprocess.Popen, object]] = []

    def start(self, argv: list[str], env: dict, name: str) -> tuple[subprocess.Popen, Path]:
        """Start `argv` in ROOT with `env`, output to `<workdir>/<name>.log`; returns (process, log path)."""
        log = self.workdir / f"{name}.log"
        fh = open(log, "wb")
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append((proc, fh))
        return proc, log

    def __enter__(self) -> "Servers":
        env = {**os.environ, "DATABASE_URL": self.database_url, "PYTHONUNBUFFERED": "1"}
        eport, gport = free_port(), free_port()
        self.engine_url = f"http://127.0.0.1:{eport}"
        self.gateway_url = f"http://127.0.0.1:{gport}"
        try:
            argv = [sys.executable, "-m", "app.conformance.scripted.check", "--harness", self.harness,
                    "--port", str(eport)]
            if self.max_model_len:
                argv += ["--max-model-len", str(self.max_model_len)]
            proc, log = self.start(argv, env, "engine")
            wait_http(self.engine_url + "/health", proc, log)
            genv = {**env, "TURNSTILE_ENGINE_URLS": self.engine_url, "TURNSTILE_GATEWAY_BIND": f"127.0.0.1:{gport}",
                    "TURNSTILE_GATEWAY_WORKERS": "1", "TURNSTILE_GATEWAY_THREADS": "16",
                    "TURNSTILE_GATEWAY_SESSION_CACHE_S": "0"}
            proc, log = self.start([sys.executable, "-m", "gunicorn", "-c", str(ROOT / "workers" / "gateway_conf.py"),
                                    "app.proxy:create_gateway_app()"], genv, "gateway")
            wait_http(self.gateway_url + "/health", proc, log)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for proc, fh in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait(timeout=5)
            fh.close()
        self.procs.clear()
