"""Backstop for lost work: re-tick running runs and re-send training steps whose trainer died.

Episode stages are late-acknowledged, so Redis redelivers them after a crash.
Training steps are acknowledged on start (a redelivery while a step still runs
would train twice), so a gpu worker killed mid-step loses its message; the
step row stays `pending`/`training`.  The watchdog (Celery beat, every
`WATCHDOG_INTERVAL_S`) asks the workers what they are running; a step that no
worker is running or holding, with nothing waiting on the gpu queue, is sent
again — the trainer resumes it from its last checkpoint (app.training.steps).
"""
from __future__ import annotations

import datetime as dt
import logging

from sqlalchemy import select

from app import scheduler
from app.db import session_scope
from app.models import Run, TrainingStep, utcnow

log = logging.getLogger("turnstile.watchdog")

WATCHDOG_INTERVAL_S = 30.0
STEP_GRACE_S = 60.0  # a step younger than this may still be on its way to a worker


def _gpu_queue_depth() -> int:
    r = scheduler.redis_client()
    return sum(r.llen(key) for key in ["gpu", *(f"gpu:{p}" for p in range(1, 10))])


def _steps_in_workers(celery_app) -> set[tuple[int, int]]:
    """(run_id, step) of every training task a live worker is running or has reserved."""
    inspect = celery_app.control.inspect(timeout=2.0)
    seen: set[tuple[int, int]] = set()
    for listing in (inspect.active() or {}, inspect.reserved() or {}):
        for tasks in listing.values():
            for task in tasks:
                if task.get("name") in ("gpu.train_step", "gpu.simulated_train_step") and len(task.get("args") or []) >= 2:
                    seen.add((int(task["args"][0]), int(task["args"][1])))
    return seen


def find_orphaned_steps(now: dt.datetime, in_workers: set[tuple[int, int]], queue_depth: int) -> list[tuple[int, int, bool]]:
    """Steps to re-send: (run_id, step, simulated) for unfinished steps of running runs that nobody holds."""
    if queue_depth:
        return []  # a message is still waiting; it may be this step's
    orphans = []
    with session_scope() as s:
        rows = s.execute(
            select(TrainingStep, Run).join(Run, Run.id == TrainingStep.run_id)
            .where(Run.status == "running", TrainingStep.status.in_(("pending", "training")))
        ).all()
        for step, run in rows:
            since = step.started_at or step.created_at
            if since.tzinfo is None:
                since = since.replace(tzinfo=dt.timezone.utc)
            if (run.id, step.step) in in_workers or (now - since).total_seconds() < STEP_GRACE_S:
                continue
            orphans.append((run.id, step.step, run.config.get("simulate") is not None))
    return orphans


def watchdog() -> dict:
    """One pass: re-send orphaned steps, tick every running run. Returns what it did."""
    from app.celery import app as celery_app
    from app.tasks.control import enqueue_train_step

    orphans = find_orphaned_steps(utcnow(), _steps_in_workers(celery_app), _gpu_queue_depth())
    for run_id, step, simulated in orphans:
        log.warning("run=%s step=%s event=resend reason=no worker holds the step", run_id, step)
        enqueue_train_step(run_id, step, simulated=simulated)
    with session_scope() as s:
        running = s.scalars(select(Run.id).where(Run.status.in_(("running", "cancelling")))).all()
    for run_id in running:
        scheduler.tick(run_id)
    return {"resent": orphans, "ticked": list(running)}
