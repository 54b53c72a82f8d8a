"""Tinker futures on real SQLite and PostgreSQL: idempotent creation on the SDK's request id,
compare-and-set claims (a lost lease is re-claimed once), finishing, and the reaper's rule that
no future stays pending or running for ever."""
from __future__ import annotations

import datetime as dt
import threading

import pytest
from sqlalchemy import func, select, update

from app.control import tinker_futures as tf
from app.db import session_scope
from app.tables import Run, TinkerFuture, TinkerModel, TinkerSession, utcnow


def _model(key: str = "alice") -> str:
    with session_scope() as s:
        run = Run(kind="tinker", status="running", config={"kind": "tinker"})
        s.add(run)
        s.flush()
        sess = TinkerSession(id=f"sess-{run.id}", key_name=key, sdk_version="0.38.0", tags=[], user_metadata={})
        s.add(sess)
        s.flush()
        s.add(TinkerModel(id=f"model-{run.id}", run_id=run.id, session_id=sess.id, seq_id=0, key_name=key,
                          base_model="tiny", lora_rank=8))
        return f"model-{run.id}"


def _create(model_id: str, request_id: str = "req-1", op: str = "forward_backward", key: str = "alice") -> int:
    with session_scope() as s:
        return tf.create(s, model_id=model_id, request_id=request_id, op=op, payload={"loss_fn": "cross_entropy"},
                         key_name=key).id


def _row(future_id: int) -> TinkerFuture:
    with session_scope() as s:
        row = s.get(TinkerFuture, future_id)
        s.expunge(row)
        return row


def test_same_request_id_is_one_row(any_database):
    model = _model()
    first = _create(model)
    assert _create(model) == first
    with session_scope() as s:
        assert s.scalar(select(func.count()).select_from(TinkerFuture)) == 1
        assert tf.get(s, "req-1", key_name="alice").id == first
        assert tf.get(s, "req-1", key_name="bob") is None  # another key cannot see it
    with pytest.raises(tf.FutureConflict):
        _create(model, op="optim_step")


def test_concurrent_retries_make_one_row(any_database):
    model = _model()
    ids, errors = [], []

    def go():
        try:
            ids.append(_create(model, request_id="race"))
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(ids)) == 1 and len(ids) == 6


def test_claim_is_compare_and_set_and_a_lost_lease_is_reclaimed_once(any_database):
    fid = _create(_model())
    with session_scope() as s:
        won = tf.claim(s, fid, lease_s=60)
        assert won is not None and won.status == "running" and won.attempts == 1
    with session_scope() as s:
        assert tf.claim(s, fid, lease_s=60) is None  # a live lease: a duplicate message
    past = utcnow() - dt.timedelta(seconds=1)
    with session_scope() as s:
        s.execute(update(TinkerFuture).where(TinkerFuture.id == fid).values(lease_expires_at=past))
    with session_scope() as s:
        again = tf.claim(s, fid, lease_s=60)
        assert again is not None and again.attempts == 2
    with session_scope() as s:
        # the first worker, taken over, can no longer finish it
        assert not tf.complete(s, fid, {"metrics": {}}, attempt=1)
        assert tf.complete(s, fid, {"metrics": {"loss:sum": 1.5}}, attempt=2)
    row = _row(fid)
    assert row.status == "completed" and row.result == {"metrics": {"loss:sum": 1.5}}
    with session_scope() as s:
        s.execute(update(TinkerFuture).where(TinkerFuture.id == fid).values(status="running", lease_expires_at=past))
    with session_scope() as s:
        assert tf.claim(s, fid, lease_s=60) is None  # out of attempts


def test_fail_and_finished_rows_stay_finished(any_database):
    fid = _create(_model())
    with session_scope() as s:
        assert tf.fail(s, fid, {"error": "unknown loss 'x'", "category": tf.USER})
        assert not tf.complete(s, fid, {})
        assert tf.claim(s, fid, lease_s=5) is None
    row = _row(fid)
    assert row.status == "failed" and row.error == {"error": "unknown loss 'x'", "category": "User"}


def test_reaper_resends_once_then_fails_and_fails_stale_pending(any_database):
    model = _model()
    running, stale, fresh = (_create(model, request_id=r) for r in ("run", "stale", "fresh"))
    now = utcnow()
    with session_scope() as s:
        tf.claim(s, running, lease_s=60)
        s.execute(update(TinkerFuture).where(TinkerFuture.id == stale)
                  .values(created_at=now - dt.timedelta(seconds=120)))
    later = now + dt.timedelta(seconds=61)
    with session_scope() as s:
        reaped = tf.reap(s, later, pending_timeout_s=100)
    assert reaped.resend == [(running, "forward_backward")]
    assert reaped.failed == [stale]
    assert _row(fresh).status == "pending"
    assert "not started within 100 s" in _row(stale).error["error"]
    with session_scope() as s:
        s.execute(update(TinkerFuture).where(TinkerFuture.id == running).values(lease_expires_at=now))
        assert tf.claim(s, running, lease_s=60).attempts == 2
    with session_scope() as s:
        reaped = tf.reap(s, later + dt.timedelta(seconds=120), pending_timeout_s=1000)
    assert reaped.failed == [running] and reaped.resend == []
    row = _row(running)
    assert row.status == "failed" and "lost 2 times" in row.error["error"] and row.error["category"] == "Server"
