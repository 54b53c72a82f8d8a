"""The SQLite engine's pragmas (`app.db`): WAL with synchronous=NORMAL by default, FULL when asked,
and a commit that a process made survives that process being killed right after it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from sqlalchemy import text

from app import config
from app.config import SettingsError
from app.db import dispose_engine, get_engine


@pytest.fixture
def sqlite_url(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'pragmas.db'}"
    monkeypatch.setenv("DATABASE_URL", url)
    config.reset_settings()
    dispose_engine()
    yield url
    dispose_engine()
    config.reset_settings()


def _pragmas() -> tuple[str, int]:
    with get_engine().connect() as conn:
        return conn.execute(text("PRAGMA journal_mode")).scalar(), conn.execute(text("PRAGMA synchronous")).scalar()


def test_sqlite_is_wal_with_synchronous_normal_unless_full_is_asked(sqlite_url, monkeypatch):
    assert _pragmas() == ("wal", 1)  # 1 = NORMAL (https://sqlite.org/pragma.html#pragma_synchronous)
    monkeypatch.setenv("TURNSTILE_SQLITE_SYNCHRONOUS", "FULL")
    config.reset_settings()
    dispose_engine()
    assert _pragmas() == ("wal", 2)  # 2 = FULL
    monkeypatch.setenv("TURNSTILE_SQLITE_SYNCHRONOUS", "OFF")
    config.reset_settings()
    dispose_engine()
    with pytest.raises(SettingsError, match="TURNSTILE_SQLITE_SYNCHRONOUS"):
        get_engine()


def test_a_commit_survives_its_process_being_killed_at_once(sqlite_url):
    """What the gateway's record-before-answer rule needs of the database: a committed row is there
    for every other process even when the committing one is SIGKILLed the next instant."""
    script = textwrap.dedent("""
        import os, signal
        from sqlalchemy import text
        from app.db import get_engine
        with get_engine().begin() as conn:
            conn.execute(text("CREATE TABLE t (v INTEGER)"))
        with get_engine().begin() as conn:
            conn.execute(text("INSERT INTO t VALUES (42)"))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), cwd=os.getcwd(), timeout=60)
    assert proc.returncode == -signal.SIGKILL
    with get_engine().connect() as conn:
        assert conn.execute(text("SELECT v FROM t")).scalars().all() == [42]
