"""Helpers for tests: wait_for, subprocess handling, celery worker command lines."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from app.config import ROOT
# The Redis server the tests use (databases are chosen per area); TURNSTILE_TEST_REDIS points a
# whole test run at another server, e.g. to run two suites side by side.
REDIS_BASE = os.environ.get("TURNSTILE_TEST_REDIS", "redis://127.0.0.1:6379")
# The API token of every API, engine and CLI a test starts (conftest.py exports it before any app
# module reads settings, so subprocesses inherit it).
API_TOKEN = os.environ.setdefault("TURNSTILE_API_TOKEN", "turnstile-test-api-token-0123456789")
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}


def api_client(flask_app):
    """A Flask test client of the API app that sends the API token on every request."""
    client = flask_app.test_client()
    client.environ_base["HTTP_AUTHORIZATION"] = AUTH["Authorization"]
    return client


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate, timeout: float, interval: float = 0.2, what="condition"):
    """Poll `predicate()` until it returns a truthy value; raise AssertionError after `timeout` s.

    `what` names the condition; a callable is called only on timeout, so logs it reads show the
    processes' state when the wait gave up, not when it began."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what() if callable(what) else what}")


class Proc:
    """A child process started in its own process group, with its output in a log file."""

    def __init__(self, args: list[str], env: dict, log_path: Path):
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.popen = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=5)
        self.log.close()


def celery_worker_args(queues: str, concurrency: int = 2, name: str = "w") -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "app", "worker", "-Q", queues, "-c", str(concurrency),
            "-n", f"{name}-{uuid.uuid4().hex[:6]}@%h", "--without-heartbeat", "--without-mingle",
            "--without-gossip", "-O", "fair", "--loglevel", "INFO"]


def read_http_request(sock) -> tuple[bytes, bytes] | None:
    """(head, body) of one HTTP/1.1 request read from `sock` (body by its content-length), or None
    when the peer closes before the head ends.  For test engines that answer raw bytes."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        if not more:
            return None
        data += more
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += sock.recv(65536)
    return head, body


def reply_json(handler, payload, status: int = 200) -> None:
    """Answer a `http.server.BaseHTTPRequestHandler` request with `payload` as JSON."""
    out = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(out)))
    handler.end_headers()
    handler.wfile.write(out)


@contextlib.contextmanager
def served_embedded_engine(spec: str = "tiny"):
    """A real embedded engine for `spec` behind its own Flask app on a free port, served from a
    thread for the `with` block: yields its URL."""
    import threading

    from werkzeug.serving import make_server

    from app.engines.embedded.engine import build_engine
    from app.engines.embedded.server import create_engine_app

    engine = build_engine(spec, threads=1)
    server = make_server("127.0.0.1", 0, create_engine_app(engine=engine, admin_token="t"), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        engine.scheduler.stop()
