"""Database engine and sessions shared by every process (api, gateway, workers, trainer).

Plain SQLAlchemy rather than Flask-SQLAlchemy: the gateway, Celery workers and
the trainer use the database outside any Flask request.  Forked workers call
`dispose_engine()` after fork so no pooled connection crosses processes.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from app.config import get_settings

_engine: Engine | None = None
_factory: sessionmaker[Session] | None = None


def _make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        # Several processes write the SQLite file: WAL lets readers run beside a
        # writer, and busy_timeout waits for the lock instead of failing.  In WAL mode,
        # synchronous=NORMAL loses no commit when a process dies (only a power loss or an OS crash
        # can roll back the last ones) and drops the disk flush from every commit: the gateway
        # commits once per model call, and that flush cost 0.5 ms here, more on a busy disk.
        synchronous = get_settings().sqlite_synchronous
        eng = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(eng, "connect")
        def _sqlite_pragmas(conn, _record):  # pragma: no cover - trivial
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute(f"PRAGMA synchronous={synchronous}")
            cur.close()

        return eng
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10)


def get_engine() -> Engine:
    """The process-wide engine for `DATABASE_URL` (created on first use)."""
    global _engine, _factory
    if _engine is None:
        _engine = _make_engine(get_settings().database_url)
        _factory = sessionmaker(_engine, expire_on_commit=False)
    return _engine


def dispose_engine() -> None:
    """Drop pooled connections and forget the engine (after fork, or when settings change)."""
    global _engine, _factory
    if _engine is not None:
        _engine.dispose()
    _engine, _factory = None, None


def new_session() -> Session:
    get_engine()
    assert _factory is not None
    return _factory()


@contextlib.contextmanager
def session_scope() -> Iterator[Session]:
    """A session that commits on success and rolls back on any exception."""
    session = new_session()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
