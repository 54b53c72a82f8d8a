"""`control` queue: start, tick and cancel runs; `gpu` simulated steps."""
from __future__ import annotations

import time

from celery import shared_task

from app import scheduler
from app.db import session_scope
from app.models import Run, TrainingStep, utcnow
from app.states import transition


@shared_task(name="control.start_run", acks_late=True)
def start_run(run_id: int) -> None:
    scheduler.start_run(run_id)


@shared_task(name="control.tick", acks_late=True)
def tick(run_id: int) -> None:
    scheduler.tick(run_id)


@shared_task(name="control.cancel_run", acks_late=True)
def cancel_run(run_id: int) -> None:
    scheduler.tick(run_id)


@shared_task(name="control.watchdog", acks_late=True)
def watchdog() -> dict:
    """Periodic backstop (Celery beat): re-send orphaned training steps, tick running runs."""
    from app.watchdog import watchdog as run_watchdog

    return run_watchdog()


@shared_task(name="control.step_failed")
def step_failed(request, exc, traceback, run_id: int, step: int) -> None:
    """Errback of a training step: record the failure so the run fails with the reason."""
    with session_scope() as s:
        row = s.query(TrainingStep).filter_by(run_id=run_id, step=step).one_or_none()
        if row is not None:
            transition(s, TrainingStep, row.id, "failed", error=f"{type(exc).__name__}: {exc}", finished_at=utcnow())
    scheduler.tick(run_id)


def enqueue_train_step(run_id: int, step: int, simulated: bool) -> None:
    """Send step `step` of run `run_id` to the gpu queue; a tick follows it, success or failure."""
    after = tick.si(run_id)
    if simulated:
        simulated_train_step.apply_async(args=[run_id, step], link=after)
        return
    from app.tasks.training import train_step as real_step

    real_step.apply_async(args=[run_id, step], link=after, link_error=step_failed.s(run_id, step))


@shared_task(name="gpu.simulated_train_step", acks_late=False)
def simulated_train_step(run_id: int, step: int) -> None:
    """A training step of fixed length (`simulate.train_s`) for the scheduler bench and tests.

    Does everything a real step does to the run's state (step row, policy version),
    only the optimizer update is replaced by a sleep.
    """
    with session_scope() as s:
        row = s.query(TrainingStep).filter_by(run_id=run_id, step=step).one()
        # pending, or training left behind by a killed worker and re-sent by the watchdog
        if not transition(s, TrainingStep, row.id, "training", expect=("pending", "training"), started_at=utcnow()):
            return
        train_s = (s.get(Run, run_id).config.get("simulate") or {}).get("train_s", 0.0)
    time.sleep(train_s)
    with session_scope() as s:
        run = s.get(Run, run_id)
        run.policy_version += 1
        row = s.query(TrainingStep).filter_by(run_id=run_id, step=step).one()
        transition(s, TrainingStep, row.id, "completed", policy_version=run.policy_version, finished_at=utcnow(),
                   metrics={**(row.metrics or {}), "simulated": True, "train_s": train_s})
