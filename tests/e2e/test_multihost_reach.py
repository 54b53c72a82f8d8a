"""A Celery worker on a machine that cannot reach the database, or (a rollout worker) the gateway,
exits at start naming the address and its setting.  The machines are network namespaces on a
bridge (support.netns); none has 127.0.0.1, so nothing reaches it by accident."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from app.celery import unreachable
from app.config import Settings
from support import ROOT
from support import netns

pytestmark = pytest.mark.slow


@pytest.fixture
def network():
    why = netns.available()
    if why:
        pytest.fail(f"the multi-host tests need network namespaces: {why}")
    with netns.Network() as net:
        yield net


def _worker(host: netns.Host, queues: str, env: dict) -> subprocess.CompletedProcess:
    argv = host.cmd([sys.executable, "-m", "celery", "-A", "app", "worker", "-Q", queues, "-c", "1",
                     "--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "INFO"])
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**env, "TURNSTILE_HOST_NAME": host.name, "TURNSTILE_REACH_TIMEOUT_S": "2"})


def _listen(address: str) -> socket.socket:
    """A TCP listener on the bridge (the test's namespace): something that accepts connections."""
    sock = socket.create_server((address, 0))
    threading.Thread(target=lambda: [sock.accept() for _ in iter(int, 1)], daemon=True).start()
    return sock


def test_a_worker_that_cannot_reach_the_database_or_the_gateway_exits_naming_it(network, tmp_path):
    rollout = network.add_host("rollout1")
    control = network.add_host("control")  # on the bridge, but nothing listens there
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TURNSTILE_VAR_DIR": str(tmp_path / "var"),
           "REDIS_URL": f"redis://{control.address}:6379/0",
           "TURNSTILE_API_TOKEN": "multihost-test-token-0123456789",
           "DATABASE_URL": f"postgresql+psycopg://turnstile@{control.address}:5432/turnstile",
           "TURNSTILE_GATEWAY_URL": f"http://{control.address}:8100"}
    result = _worker(rollout, "prepare,grade", env)
    assert result.returncode == 1, result.stderr[-3000:]
    assert (f"cannot reach the database at {control.address}:5432 (DATABASE_URL) from this machine (rollout1)"
            in result.stderr), result.stderr[-3000:]
    # The database answers now (a listener on the bridge); the gateway still does not.
    db = _listen(network.gateway_address)
    env["DATABASE_URL"] = f"postgresql+psycopg://turnstile@{network.gateway_address}:{db.getsockname()[1]}/turnstile"
    result = _worker(rollout, "rollout", env)
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"cannot reach the gateway at {control.address}:8100 (TURNSTILE_GATEWAY_URL)" in result.stderr
    db.close()


def test_what_is_checked(tmp_path):
    """Loopback addresses start beside the worker (`make up`) and SQLite is a file: not checked;
    the gateway matters only to rollout workers."""
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    local = Settings(var_dir=tmp_path, database_url=f"postgresql+psycopg://x@127.0.0.1:{port}/x",
                     gateway_url=f"http://localhost:{port}", reach_timeout_s=0)
    assert unreachable(["rollout"], local) is None
    assert unreachable(["grade"], Settings(var_dir=tmp_path, reach_timeout_s=0)) is None  # SQLite
    elsewhere = Settings(var_dir=tmp_path, gateway_url="http://gateway.invalid:8100", reach_timeout_s=0)
    assert unreachable(["prepare", "grade"], elsewhere) is None
    assert "cannot reach the gateway at gateway.invalid:8100 (TURNSTILE_GATEWAY_URL)" in unreachable(["rollout"], elsewhere)
