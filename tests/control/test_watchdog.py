"""The watchdog re-sends a training step whose gpu worker died (its early-acked message is gone)."""
from __future__ import annotations

import datetime as dt

from app.control import watchdog
from app.tasks import control as control_tasks
from app.db import session_scope
from app.tables import Run, TrainingStep
from support import REDIS_BASE, celery_worker_args, wait_for

REDIS_DB = 10


def _run_with_step(status: str, started_ago_s: float) -> int:
    with session_scope() as s:
        run = Run(kind="train", status="running", config={"simulate": {"train_s": 0.0}, "steps": 1})
        s.add(run)
        s.flush()
        s.add(TrainingStep(run_id=run.id, step=0, status=status,
                           started_at=dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=started_ago_s)))
        return run.id


def test_orphaned_step_is_found_only_when_nobody_holds_it(database):
    run_id = _run_with_step("training", 120)
    now = dt.datetime.now(dt.timezone.utc)
    assert watchdog.find_orphaned_steps(now, set(), 0) == [(run_id, 0)]
    assert watchdog.find_orphaned_steps(now, {(run_id, 0)}, 0) == []  # a worker is on it
    assert watchdog.find_orphaned_steps(now, set(), 1) == []  # a message is still queued
    fresh = _run_with_step("pending", 1)
    assert (fresh, 0) not in watchdog.find_orphaned_steps(now, set(), 0)  # within the grace period


def test_watchdog_resends_and_a_worker_finishes_the_step(database, redis_db, spawn):
    run_id = _run_with_step("training", 300)  # as left by a gpu worker killed mid-step
    done = control_tasks.watchdog()  # the beat's task, run here in-process: asks workers (none) and Redis
    assert done["resent"] == [(run_id, 0)] and run_id in done["ticked"]
    spawn(celery_worker_args("gpu,control", concurrency=1, name="gpu"),
          {"DATABASE_URL": database, "REDIS_URL": f"{REDIS_BASE}/10"}, "gpu")

    def completed():
        with session_scope() as s:
            return s.query(TrainingStep).filter_by(run_id=run_id).one().status == "completed"

    wait_for(completed, 60, what="the re-sent step to complete")
    with session_scope() as s:
        assert s.get(Run, run_id).policy_version == 1


def test_sweep_removes_abandoned_runtimes_and_keeps_live_ones(database, tmp_path, monkeypatch):
    """A killed worker's runtime folder (old, no live episode) is deleted; a live episode's is kept,
    and so is a young folder a prepare or grade may still be building."""
    import os
    import time

    from app import config
    from app.tables import Episode, TaskInstance
    from app.runtimes.paths import RuntimePaths

    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("TURNSTILE_CACHE_DIR", str(tmp_path / "cache"))
    config.reset_settings()
    root = RuntimePaths.from_settings().runtimes
    old = time.time() - 2 * config.get_settings().task_time_limit
    for name in ("episo-abandoned", "episo-live", "grade-young"):
        (root / name / "workspace").mkdir(parents=True)
    for name in ("episo-abandoned", "episo-live"):
        os.utime(root / name, (old, old))
    with session_scope() as s:
        run = Run(kind="eval", status="running", config={})
        inst = TaskInstance(task_set="t", instance_id="i", repo="r", record={})
        s.add_all([run, inst])
        s.flush()
        s.add(Episode(run_id=run.id, instance_id=inst.id, group_index=0, sample_index=0, status="running",
                      runtime={"kind": "local", "id": "episo-live"}))
    assert watchdog.sweep_runtimes() == ["episo-abandoned"]
    assert sorted(p.name for p in root.iterdir()) == ["episo-live", "grade-young"]


def test_a_run_whose_start_message_was_lost_is_started_again(database, monkeypatch):
    """A run still `queued` a lease period plus a watchdog period after creation lost its start
    message (e.g. Redis restarted before a control worker took it): the watchdog sends it again;
    a just-created run and a running one are left alone."""
    from app import config

    monkeypatch.setenv("TURNSTILE_LEASE_TTL_S", "10")
    monkeypatch.setenv("TURNSTILE_WATCHDOG_INTERVAL_S", "5")
    config.reset_settings()
    now = dt.datetime.now(dt.timezone.utc)
    with session_scope() as s:
        lost = Run(kind="eval", status="queued", config={}, created_at=now - dt.timedelta(seconds=16))
        fresh = Run(kind="eval", status="queued", config={}, created_at=now - dt.timedelta(seconds=14))
        running = Run(kind="eval", status="running", config={}, created_at=now - dt.timedelta(seconds=600),
                      started_at=now - dt.timedelta(seconds=600), summary={"instance_ids": [1]})
        s.add_all([lost, fresh, running])
        s.flush()
        ids = lost.id, fresh.id, running.id
    plan = watchdog.watchdog(set(), 0)
    assert plan.start == [ids[0]]
    assert ids[2] in plan.tick and ids[0] not in plan.tick
    config.reset_settings()
