"""Alembic migrations upgrade and downgrade cleanly on SQLite and PostgreSQL, with one head."""
from __future__ import annotations

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect

from app.tables import Base

from support import ROOT


def _alembic(url: str) -> Config:
    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("sqlalchemy.url", url)
    return cfg


def test_single_head():
    heads = ScriptDirectory.from_config(_alembic("sqlite://")).get_heads()
    assert len(heads) == 1, f"migration graph has several heads: {heads}"


def _roundtrip(url: str) -> None:
    cfg = _alembic(url)
    command.upgrade(cfg, "head")
    engine = create_engine(url)
    tables = set(inspect(engine).get_table_names())
    assert set(Base.metadata.tables) <= tables, f"missing after upgrade: {set(Base.metadata.tables) - tables}"
    # The migrated schema has every column the models declare (no drift between the two).
    for name, table in Base.metadata.tables.items():
        cols = {c["name"] for c in inspect(engine).get_columns(name)}
        assert {c.name for c in table.columns} == cols, name
    engine.dispose()
    command.downgrade(cfg, "base")
    engine = create_engine(url)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    engine.dispose()
    command.upgrade(cfg, "head")  # and up again after a full downgrade


def test_upgrade_downgrade_sqlite(sqlite_url):
    _roundtrip(sqlite_url)


def test_upgrade_downgrade_postgresql(pg_url):
    _roundtrip(pg_url)
