"""`control.step_failed` on a real gpu worker: a training step whose closing write meets a real
PostgreSQL outage is sent again and completes, the run does not fail, and the step counts the retry.

PostgreSQL only (see tests/control/test_episodes.py: SQLite has no connection to drop).
"""
from __future__ import annotations

import time

import pytest
from sqlalchemy import select

from app import db
from app.db import session_scope
from app.tables import Run, TrainingStep
from support import REDIS_BASE, celery_worker_args, wait_for
from support.faults import cut_database, postgres_process_env, restore_database

REDIS_DB = 10


@pytest.fixture
def postgres(pg_url, monkeypatch, tmp_path):
    yield from postgres_process_env(pg_url, monkeypatch, tmp_path)


def test_a_database_outage_at_a_steps_closing_write_resends_the_step(postgres, redis_db, spawn):
    from app.tasks.send import send_start_run

    worker = spawn(celery_worker_args("control,prepare,rollout,grade,gpu", concurrency=3), postgres, name="all")
    with session_scope() as s:
        run = Run(kind="train", status="queued", config={
            "kind": "train", "group_size": 2, "tasks_per_step": 1, "steps": 1,
            "simulate": {"episode_median_s": 0.1, "train_s": 4.0, "reward_p": 0.5, "seed": 1}})
        s.add(run)
        s.flush()
        run_id = run.id
    send_start_run(run_id, 9)

    def training():
        with session_scope() as s:
            return s.scalar(select(TrainingStep.id).where(TrainingStep.run_id == run_id,
                                                          TrainingStep.status == "training"))

    wait_for(training, 60, what=f"the step to start training\n{worker.output()[-3000:]}")
    db.dispose_engine()
    cut_database(postgres["DATABASE_URL"])
    # The outage lasts until the step's closing write has failed on it and the errback is retrying
    # its count of the transient failure (logged), however long a loaded box takes; the wait only
    # bounds a hang.
    met = f"event=retry what=run {run_id} step 0 retry"
    wait_for(lambda: met in worker.output(), 60, interval=0.2,
             what=lambda: f"the step's closing write to meet the outage\n{worker.output()[-3000:]}")
    restore_database(postgres["DATABASE_URL"])

    def finished():
        with session_scope() as s:
            return s.get(Run, run_id).status in ("completed", "failed")

    wait_for(finished, 60, interval=0.5, what=f"the run to finish\n{worker.output()[-3000:]}")
    with session_scope() as s:
        run = s.get(Run, run_id)
        step = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id))
        assert run.status == "completed", (run.error, worker.output()[-3000:])
        assert step.status == "completed" and run.policy_version == 1
        assert step.metrics["transient_retries"] == 1
        assert step.metrics["transient_error"].startswith("OperationalError"), step.metrics["transient_error"]


def test_two_watchdog_passes_at_once_send_a_lost_step_once(database, redis_db, tmp_path):
    """Two processes run the watchdog's pass at the same moment (two beats, or a redelivered
    message): a training step no worker holds is sent to the gpu queue once, not twice."""
    import datetime as dt
    import json
    import os
    import subprocess
    import sys

    with session_scope() as s:
        run = Run(kind="train", status="running", config={"simulate": {"train_s": 0.0}, "steps": 1},
                  started_at=dt.datetime.now(dt.timezone.utc), summary={"instance_ids": [1]})
        s.add(run)
        s.flush()
        s.add(TrainingStep(run_id=run.id, step=0, status="training",
                           started_at=dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=300)))
        run_id = run.id
    env = {**os.environ, "DATABASE_URL": database, "REDIS_URL": f"{REDIS_BASE}/10",
           "TURNSTILE_VAR_DIR": str(tmp_path / "var")}
    # Both processes import first, then start their pass at the same wall-clock instant.
    from app.tasks import control as control_tasks

    code = ("import json, sys, time; from app.tasks import control; "
            "time.sleep(max(0.0, float(sys.argv[1]) - time.time())); print(json.dumps(control.watchdog()))")
    at = str(time.time() + 15)
    passes = [subprocess.Popen([sys.executable, "-c", code, at], env=env, stdout=subprocess.PIPE, text=True)
              for _ in range(2)]
    reports = [json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1]) for p in passes]
    assert sum(len(r.get("resent", [])) for r in reports) == 1, reports
    assert [r["resent"] for r in reports if "resent" in r] in ([[[run_id, 0]]], [[[run_id, 0]], []]), reports
    assert control_tasks._gpu_queue_depth() == 1


def test_beat_runs_the_watchdog_pass_with_no_worker_free(database, redis_db, spawn, tmp_path):
    """A real `celery beat` and no worker at all on the control queue (as when every cpu-worker child
    runs a long grade): a training step that no worker holds is still sent again, by beat's own
    pass, within seconds of beat's start."""
    import datetime as dt
    import sys

    with session_scope() as s:
        run = Run(kind="train", status="running", config={"simulate": {"train_s": 0.0}, "steps": 1},
                  started_at=dt.datetime.now(dt.timezone.utc), summary={"instance_ids": [1]})
        s.add(run)
        s.flush()
        s.add(TrainingStep(run_id=run.id, step=0, status="training",
                           started_at=dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=300)))
    env = {"DATABASE_URL": database, "REDIS_URL": f"{REDIS_BASE}/10", "TURNSTILE_VAR_DIR": str(tmp_path / "var"),
           "TURNSTILE_WATCHDOG_INTERVAL_S": "2"}
    beat = spawn([sys.executable, "-m", "celery", "-A", "app", "beat", "--loglevel", "INFO",
                  "-s", str(tmp_path / "celerybeat-schedule")], env, name="beat")
    from app.tasks.control import _gpu_queue_depth

    wait_for(lambda: _gpu_queue_depth() >= 1, 30, what=f"the lost step to be re-sent\n{beat.output()[-3000:]}")
    # Two more of beat's passes (counted in its log): the step's message waits on the gpu queue, so
    # it is not sent again.
    passes = beat.output().count("event=watchdog_pass in=beat")
    wait_for(lambda: beat.output().count("event=watchdog_pass in=beat") >= passes + 2, 60,
             what=lambda: f"two more watchdog passes\n{beat.output()[-3000:]}")
    assert _gpu_queue_depth() == 1, beat.output()[-3000:]
