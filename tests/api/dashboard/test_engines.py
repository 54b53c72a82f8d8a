"""The runs list's Engines table data (`engine_sharing`) on a real SQLite database and Redis."""
from __future__ import annotations

import redis as redis_lib

from app import weight_gate
from app.api.dashboard.engines import engine_sharing
from app.config import get_settings
from app.db import session_scope
from app.runconfig import RunConfig
from app.tables import Run


def _live_lora_run() -> int:
    cfg = RunConfig.model_validate({"kind": "train", "training": {"lora": True}})
    with session_scope() as s:
        run = Run(kind="train", config=cfg.model_dump(mode="json"), status="running")
        s.add(run)
        s.flush()
        return run.id


def test_each_engine_carries_the_calls_held_at_its_weight_reloads(database, redis_db):
    run_id = _live_lora_run()
    url = get_settings().engine_urls[0]
    with session_scope() as s:
        (engine,) = engine_sharing(s)
    assert engine["url"] == url and [r["id"] for r in engine["runs"]] == [run_id]
    assert engine["held"] == {"requests": 0, "seconds": 0.0, "holding": 0}  # never reloaded under a call
    weight_gate.record_hold(url, 2.5)
    with weight_gate.holding(url), session_scope() as s:
        assert engine_sharing(s)[0]["held"] == {"requests": 1, "seconds": 2.5, "holding": 1}


def test_an_unreadable_redis_leaves_the_hold_counts_unknown_and_the_table_whole(database, monkeypatch):
    run_id = _live_lora_run()
    dead = redis_lib.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    monkeypatch.setattr(weight_gate, "_redis", lambda: dead)
    with session_scope() as s:
        (engine,) = engine_sharing(s)
    assert engine["held"] is None and engine["runs"][0]["id"] == run_id
