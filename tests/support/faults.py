"""Real faults for crash-safety tests: a PostgreSQL database that drops and refuses connections,
and a disk that is full to the last byte."""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

from sqlalchemy import create_engine, text

PG_ADMIN_URL = os.environ.get("TURNSTILE_TEST_PG_ADMIN", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


def _admin(sql: str, **params) -> None:
    engine = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text(sql), params)
    finally:
        engine.dispose()


def cut_database(url: str) -> None:
    """Drop every connection to the database of `url` and refuse new ones (even a superuser's:
    `ALLOW_CONNECTIONS false`): what a PostgreSQL restart or failover looks like to its clients,
    who get `OperationalError` until `restore_database`."""
    name = url.rsplit("/", 1)[1]
    _admin(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
    _admin("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :name AND pid <> pg_backend_pid()",
           name=name)


def restore_database(url: str) -> None:
    """Accept connections to the database of `url` again."""
    name = url.rsplit("/", 1)[1]
    _admin(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')


def postgres_process_env(pg_url: str, monkeypatch, tmp_path, **env: str):
    """This process's settings on the fresh PostgreSQL database `pg_url` (schema created), with a
    10 s lease and 3 redeliveries unless `env` says otherwise; yields the environment for the
    workers a test spawns, then restores the database (a test may have cut it) and the settings."""
    from app import config, db
    from app.tables import Base
    from support import REDIS_BASE

    env = {"DATABASE_URL": pg_url, "REDIS_URL": f"{REDIS_BASE}/10", "TURNSTILE_VAR_DIR": str(tmp_path / "var"),
           "TURNSTILE_LEASE_TTL_S": "10", "TURNSTILE_MAX_REDELIVERIES": "3", **env}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config.reset_settings()
    db.dispose_engine()
    Base.metadata.create_all(db.get_engine())
    yield env
    restore_database(pg_url)
    db.dispose_engine()
    config.reset_settings()


@contextlib.contextmanager
def full_disk(folder: Path, size: str = "1m"):
    """Mount a real tmpfs of `size` on `folder` (created) and fill it to the last byte; yields the
    filler file: unlink it and space returns.  Unmounted on exit.  Needs root (CI runs as root)."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    fill = folder / "fill"
    try:
        subprocess.run(["dd", "if=/dev/zero", f"of={fill}", "bs=64k"], capture_output=True)  # exits 1 at ENOSPC
        yield fill
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
