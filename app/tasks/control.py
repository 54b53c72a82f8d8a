"""`control` queue: start, tick and cancel runs; the watchdog; a failed training step's errback."""
from __future__ import annotations

from billiard.exceptions import WorkerLostError
from celery import shared_task

from app.control import runs, scheduler, watchdog as control_watchdog
from app.db import session_scope
from app.models import TrainingStep, utcnow
from app.redis_client import get_redis
from app.states import transition
from app.tasks.send import send

TRAIN_TASK = "gpu.train_step"


@shared_task(name="control.start_run", acks_late=True)
def start_run(run_id: int) -> None:
    send(runs.start_run(run_id))


@shared_task(name="control.tick", acks_late=True)
def tick(run_id: int) -> None:
    send(scheduler.tick(run_id))


@shared_task(name="control.cancel_run", acks_late=True)
def cancel_run(run_id: int) -> None:
    send(scheduler.tick(run_id))


@shared_task(name="control.watchdog", acks_late=True)
def watchdog() -> dict:
    """Periodic backstop (Celery beat): re-send orphaned training steps, tick running runs, sweep
    runtimes, put restarted engines back on their run's newest weights."""
    plan = control_watchdog.watchdog(_steps_in_workers(), _gpu_queue_depth())
    send(plan)
    return {"resent": plan.train, "ticked": plan.tick, "runtimes_removed": control_watchdog.sweep_runtimes(),
            "engines_resynced": control_watchdog.resync_engines()}


@shared_task(name="control.step_failed")
def step_failed(request, exc, traceback, run_id: int, step: int) -> None:
    """Errback of a training step: record a real failure so the run fails with the reason.

    A lost worker (its pool child killed: `WorkerLostError`) is not a failure of the step:
    the step stays `training`, the watchdog re-sends it once no worker holds it, and the
    trainer resumes from its newest checkpoint.
    """
    if isinstance(exc, WorkerLostError):
        return
    with session_scope() as s:
        row = s.query(TrainingStep).filter_by(run_id=run_id, step=step).one_or_none()
        if row is not None:
            transition(s, TrainingStep, row.id, "failed", error=f"{type(exc).__name__}: {exc}", finished_at=utcnow())
    send(scheduler.tick(run_id))


def _gpu_queue_depth() -> int:
    """Messages waiting on the gpu queue: kombu's Redis transport keeps one list per priority
    level, `gpu` for 0 and `gpu<sep><p>` for the others (sep ":" in app/celery.py)."""
    r = get_redis()
    return sum(r.llen(key) for key in ["gpu", *(f"gpu:{p}" for p in range(1, 10))])


def _steps_in_workers() -> set[tuple[int, int]]:
    """(run_id, step) of every training task a live worker is running or has reserved."""
    from app.celery import app as celery_app

    inspect = celery_app.control.inspect(timeout=2.0)
    seen: set[tuple[int, int]] = set()
    for listing in (inspect.active() or {}, inspect.reserved() or {}):
        for tasks in listing.values():
            for task in tasks:
                if task.get("name") == TRAIN_TASK and len(task.get("args") or []) >= 2:
                    seen.add((int(task["args"][0]), int(task["args"][1])))
    return seen
