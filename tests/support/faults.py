"""Real faults for crash-safety tests: a PostgreSQL database that drops and refuses connections."""
from __future__ import annotations

import os

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
