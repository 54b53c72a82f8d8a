"""Gateway test stack: a real scripted engine subprocess and the real gateway under gunicorn.

`gw_stack` (one per test session) starts both on free ports over one SQLite file;
`gw` binds this process's database to it; `episode` creates a running episode and
issues its session token; `sdk` builds real SDK clients whose streams are all checked
by the API's event-grammar validator when the test ends.  Helpers: gateway_support.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app import config, db  # noqa: E402
from app.tables import Base  # noqa: E402
from support.gateway import (ROOT, SDKs, Stack, free_port, make_episode, start_engine,  # noqa: E402
                             start_gateway, stop, wait_http)


WORKER_CLASSES = ("gevent", "gthread")


def pytest_generate_tests(metafunc):
    """A test marked `both_worker_classes` runs against a gateway of each gunicorn worker class.
    Each class is a stack of its own, started when the tests of that class begin: keep the mark to
    a module or two (the SDK event order and the slow client), not on tests spread over many."""
    if metafunc.definition.get_closest_marker("both_worker_classes") and "gw_stack" in metafunc.fixturenames:
        metafunc.parametrize("gw_stack", WORKER_CLASSES, indirect=True, scope="session")


@pytest.fixture(scope="session")
def gw_stack(request, tmp_path_factory):
    worker_class = getattr(request, "param", None)
    tmp = tmp_path_factory.mktemp(f"gateway-{worker_class or 'default'}")
    db_url = f"sqlite:///{tmp / 'gateway.db'}"
    from sqlalchemy import create_engine
    eng = create_engine(db_url)
    Base.metadata.create_all(eng)
    eng.dispose()
    eport, gport = free_port(), free_port()
    procs = [start_engine(eport, "--max-model-len", "4096")]
    try:
        wait_http(f"http://127.0.0.1:{eport}/health")
        procs.append(start_gateway(gport, db_url, f"http://127.0.0.1:{eport}", tmp / "gateway.log", worker_class))
        wait_http(f"http://127.0.0.1:{gport}/health")
        yield Stack(db_url, f"http://127.0.0.1:{eport}", f"http://127.0.0.1:{gport}", procs, worker_class)
    finally:
        stop(procs)


@pytest.fixture
def gw(gw_stack, monkeypatch):
    """The stack, with this process's database bound to the gateway's."""
    monkeypatch.setenv("DATABASE_URL", gw_stack.db_url)
    config.reset_settings()
    db.dispose_engine()
    yield gw_stack
    db.dispose_engine()
    config.reset_settings()


@pytest.fixture
def episode(gw) -> tuple[int, str]:
    return make_episode()


@pytest.fixture
def sdk(gw):
    clients = SDKs(gw.gateway_url)
    yield clients
    clients.validated()  # every stream of the test obeys its API's grammar
    clients.http.close()


@pytest.fixture(scope="module")
def real(gw_stack, tmp_path_factory):
    """A real embedded engine (tiny model) and a gateway in front of it, per test module:
    (engine URL, gateway URL).  Module scope: a module that reloads weights gets its own."""
    eport, gport = free_port(), free_port()
    log = open(tmp_path_factory.mktemp("real") / "engine.log", "wb")
    procs = [subprocess.Popen([sys.executable, "-m", "app.engines.embedded.server", "--model", "tiny", "--port", str(eport),
                               "--threads", "1", "--max-model-len", "2048"], cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})]
    try:
        wait_http(f"http://127.0.0.1:{eport}/health", timeout=180)
        procs.append(start_gateway(gport, gw_stack.db_url, f"http://127.0.0.1:{eport}",
                                   tmp_path_factory.mktemp("realgw") / "gateway.log"))
        wait_http(f"http://127.0.0.1:{gport}/health")
        yield f"http://127.0.0.1:{eport}", f"http://127.0.0.1:{gport}"
    finally:
        stop(procs)
