"""A stage's closing write survives a database blip: a real PostgreSQL outage (connections dropped
and refused) while a real worker's rollout finishes does not redo the rollout or spend a redelivery.

PostgreSQL only: SQLite has no connection to drop, and its file lock is waited for (busy_timeout
30 s) rather than failing, so the same outage is not one there.
"""
from __future__ import annotations


import pytest
from sqlalchemy import select

from app import db
from app.control import watchdog
from app.db import session_scope
from app.tables import Episode, Run
from support import celery_worker_args, wait_for
from support.faults import cut_database, postgres_process_env, restore_database

REDIS_DB = 10


@pytest.fixture
def postgres(pg_url, monkeypatch, tmp_path):
    """The process database on a fresh PostgreSQL; leases of 10 s renewed every second."""
    yield from postgres_process_env(pg_url, monkeypatch, tmp_path, TURNSTILE_LEASE_RENEW_S="1")


def test_a_database_outage_at_a_rollouts_closing_write_keeps_the_rollout(postgres, redis_db, spawn):
    from app.tasks.send import send, send_start_run

    worker = spawn(celery_worker_args("control,prepare,rollout,grade", concurrency=2), postgres, name="cpu")
    with session_scope() as s:
        run = Run(kind="eval", status="queued", config={
            "kind": "eval", "group_size": 1, "tasks_per_step": 1,
            "simulate": {"episode_median_s": 4.0, "episode_sigma": 0.0}})
        s.add(run)
        s.flush()
        run_id = run.id
    send_start_run(run_id, 9)

    def rolling_out():
        with session_scope() as s:
            return s.scalar(select(Episode.id).where(Episode.run_id == run_id, Episode.status == "running",
                                                     Episode.attempts == 1))

    episode_id = wait_for(rolling_out, 60, what=f"the rollout to start\n{worker.output()[-3000:]}")
    db.dispose_engine()
    cut_database(postgres["DATABASE_URL"])
    # The outage lasts until the rollout's closing writes have met it (the worker logs the retry),
    # however long a loaded box takes to get there; the wait only bounds a hang.
    met = f"event=retry what=episode {episode_id} "
    wait_for(lambda: met in worker.output(), 60, interval=0.2,
             what=lambda: f"the rollout's closing write to meet the outage\n{worker.output()[-3000:]}")
    restore_database(postgres["DATABASE_URL"])

    def finished():
        plans, _ = watchdog.recover_episodes(None)  # the beat's pass: would re-dispatch a lost stage
        for plan in plans:
            send(plan)
        with session_scope() as s:
            return s.get(Run, run_id).status in ("completed", "failed")

    wait_for(finished, 60, interval=1.0, what=f"the run to finish\n{worker.output()[-3000:]}")
    with session_scope() as s:
        ep = s.get(Episode, episode_id)
        assert s.get(Run, run_id).status == "completed"
        assert (ep.status, ep.attempts, ep.redeliveries) == ("completed", 1, 0), (ep.status, ep.attempts,
                                                                                  ep.redeliveries, ep.error)
    assert "event=retry what=episode" in worker.output(), "the outage never met the closing write"
