"""Backstop for lost work: re-send training steps whose trainer died, tick running runs.

Episode stages are late-acknowledged, so Redis redelivers them after a crash.  Training
steps are acknowledged on start (a redelivery while a step still runs would train twice),
so a gpu worker killed mid-step loses its message; the step row stays `pending`/`training`.
Every `WATCHDOG_INTERVAL_S` the task layer asks the workers what they are running and how
many messages wait on the gpu queue, and calls `watchdog` with the answers: a step that no
worker is running or holding, with nothing waiting on the gpu queue, is sent again — the
trainer resumes it from its last checkpoint (`app.training.steps`).
"""
from __future__ import annotations

import datetime as dt
import logging

from sqlalchemy import select

from app.control.plan import Plan
from app.db import session_scope
from app.models import Run, TrainingStep, utcnow

log = logging.getLogger("turnstile.watchdog")

WATCHDOG_INTERVAL_S = 30.0
STEP_GRACE_S = 60.0  # a step younger than this may still be on its way to a worker


def find_orphaned_steps(now: dt.datetime, in_workers: set[tuple[int, int]], queue_depth: int) -> list[tuple[int, int]]:
    """(run_id, step) of unfinished steps of running runs that nobody holds.

    `in_workers`: (run_id, step) of every training task a live worker runs or has reserved;
    `queue_depth`: messages waiting on the gpu queue (any of them may be one of these steps,
    so nothing is re-sent while it is non-zero).
    """
    if queue_depth:
        return []
    orphans = []
    with session_scope() as s:
        rows = s.execute(
            select(TrainingStep.run_id, TrainingStep.step, TrainingStep.started_at, TrainingStep.created_at)
            .join(Run, Run.id == TrainingStep.run_id)
            .where(Run.status == "running", TrainingStep.status.in_(("pending", "training")))
        ).all()
    for run_id, step, started_at, created_at in rows:
        since = started_at or created_at
        if since.tzinfo is None:
            since = since.replace(tzinfo=dt.timezone.utc)
        if (run_id, step) in in_workers or (now - since).total_seconds() < STEP_GRACE_S:
            continue
        orphans.append((run_id, step))
    return orphans


def watchdog(in_workers: set[tuple[int, int]], queue_depth: int) -> Plan:
    """One pass: the orphaned steps to re-send and every running (or cancelling) run to tick."""
    orphans = find_orphaned_steps(utcnow(), in_workers, queue_depth)
    for run_id, step in orphans:
        log.warning("run=%s step=%s event=resend reason=no worker holds the step", run_id, step)
    with session_scope() as s:
        running = list(s.scalars(select(Run.id).where(Run.status.in_(("running", "cancelling")))))
    return Plan(train=orphans, tick=running)
