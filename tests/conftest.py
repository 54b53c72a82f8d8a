"""Shared fixtures: a real database (SQLite file per test, or PostgreSQL) and a real Redis.

Areas keep their own Redis database number (REDIS_DB_<AREA> below) so suites
that flush Redis never wipe each other's keys when run side by side.
"""
from __future__ import annotations

import os
import signal
import tempfile
import uuid
from pathlib import Path

# This process's own var folder, and under pytest-xdist its own Redis server (before settings are read).
from worker_isolation import isolate_test_process  # a top-level module: importing the support package first would read its settings too early

isolate_test_process()

# Before any app module reads settings: the broker and app data live in Redis DB 10
# during tests, never in the DB 0 a developer's running deployment uses.
os.environ.setdefault("REDIS_URL", os.environ.get("TURNSTILE_TEST_REDIS", "redis://127.0.0.1:6379") + "/10")
# Tests write task sets into their temporary folders: allow those as task-set paths (in this
# process and every server or worker it starts).
os.environ.setdefault("TURNSTILE_TASK_DIRS", tempfile.gettempdir())
# One API token for the API, engines and CLI of the whole session (support.API_TOKEN reads it back).
os.environ.setdefault("TURNSTILE_API_TOKEN", "turnstile-test-api-token-0123456789")

import pytest  # noqa: E402 (after the environment above is set)
import redis as redis_lib  # noqa: E402 (after the environment above is set)
from sqlalchemy import create_engine, text  # noqa: E402 (after the environment above is set)

from app import config, db  # noqa: E402 (after the environment above is set)
from app.tables import Base  # noqa: E402 (after the environment above is set)
from support import REDIS_BASE, Proc  # noqa: E402 (after the environment above is set)

PG_ADMIN_URL = os.environ.get("TURNSTILE_TEST_PG_ADMIN", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


def _use_database(monkeypatch, url: str) -> None:
    monkeypatch.setenv("DATABASE_URL", url)
    config.reset_settings()
    db.dispose_engine()


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'turnstile.db'}"


@pytest.fixture
def pg_url():
    """A fresh, empty PostgreSQL database for one test; dropped afterwards."""
    name = f"turnstile_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        yield url
    finally:
        db.dispose_engine()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def database(monkeypatch, sqlite_url):
    """SQLite database with all tables, bound as the process database."""
    _use_database(monkeypatch, sqlite_url)
    Base.metadata.create_all(db.get_engine())
    yield sqlite_url
    db.dispose_engine()
    config.reset_settings()


@pytest.fixture(params=["sqlite", "postgresql"])
def any_database(request, monkeypatch, tmp_path):
    """Run a test on both SQLite and PostgreSQL (tables created from the models)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'turnstile.db'}"
    else:
        url = request.getfixturevalue("pg_url")
    _use_database(monkeypatch, url)
    Base.metadata.create_all(db.get_engine())
    yield url
    db.dispose_engine()
    config.reset_settings()


def redis_url_for(db_number: int) -> str:
    return f"{REDIS_BASE}/{db_number}"


@pytest.fixture
def redis_db(request):
    """A flushed real Redis database; the number comes from the test module's REDIS_DB (default 10)."""
    number = getattr(request.module, "REDIS_DB", 10)
    client = redis_lib.Redis.from_url(redis_url_for(number))
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def one_thread():
    """One torch intra-op thread for the test: its matrices are tiny, and on a shared 2-core box
    OpenMP's spinning threads made such steps many times slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def spawn(tmp_path):
    """Start real subprocesses (celery workers, servers); all are killed at teardown."""
    procs: list[Proc] = []

    def _spawn(args: list[str], env_overrides: dict | None = None, name: str = "proc") -> Proc:
        env = {**os.environ, **(env_overrides or {})}
        proc = Proc(args, env, tmp_path / f"{name}-{len(procs)}.log")
        procs.append(proc)
        return proc

    yield _spawn
    for proc in procs:
        proc.kill(signal.SIGTERM)


# --- vLLM under pytest-xdist ------------------------------------------------------------------
# tests/vllm needs one vLLM server (about two minutes to start).  Every xdist worker collects the
# whole suite, so the folder's own conftest would start one server per worker; instead the
# controller starts it here, before the workers exist, and they inherit its address.
_controller_vllm = None


def _selects_vllm_tests(config) -> bool:
    vllm_dir = Path(__file__).parent / "vllm"
    args = [Path(a.split("::")[0]).resolve() for a in config.args] or [Path(__file__).parent]
    return any(vllm_dir == a or vllm_dir.is_relative_to(a) or a.is_relative_to(vllm_dir) for a in args)


def pytest_configure(config):
    global _controller_vllm
    is_controller = getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")
    if (is_controller and not config.option.collectonly and not os.environ.get("TURNSTILE_TEST_VLLM_URL")
            and _selects_vllm_tests(config)):
        from support.vllm_server import VLLMServer

        _controller_vllm = VLLMServer()
        if _controller_vllm.error is None:
            os.environ["TURNSTILE_TEST_VLLM_URL"] = _controller_vllm.url
            os.environ["TURNSTILE_TEST_VLLM_LOG"] = str(_controller_vllm.log_path)


def pytest_unconfigure(config):
    if _controller_vllm is not None:
        _controller_vllm.stop()


def _order_seed(config) -> str | None:
    """pytest-randomly's seed of this run's test order (files, then the tests in each, shuffled)."""
    seed = getattr(config.option, "randomly_seed", None)
    return f"test order: --randomly-seed={seed} replays it (-p no:randomly keeps the files' own)" \
        if isinstance(seed, int) and not hasattr(config, "workerinput") else None


def pytest_sessionstart(session):
    # `-q` (make test) hides pytest-randomly's header line; a run stopped by a time limit still shows it here.
    line = _order_seed(session.config)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if line and reporter is not None:
        reporter.write_line(line)


def pytest_terminal_summary(terminalreporter, config):
    line = _order_seed(config)
    if line:
        terminalreporter.write_line(line)
