"""`control` queue: start, tick and cancel runs; the watchdog; a failed training step's errback."""
from __future__ import annotations

import base64
import json

from billiard.exceptions import WorkerLostError
from celery import shared_task

from app.control import runs, scheduler, watchdog as control_watchdog
from app.db import session_scope
from app.tables import TrainingStep, utcnow
from app.redis_client import get_redis
from app.transitions import transition
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
    """Periodic backstop (Celery beat): rebuild Redis state from SQL, re-dispatch episode stages
    whose lease expired, re-send orphaned training steps, tick running runs, sweep runtimes, put
    restarted engines back on their run's newest weights."""
    queued = _queued_episode_stages()  # the queues first, then the workers (a message moves that way)
    in_workers = _tasks_in_workers()
    recovery, report = control_watchdog.recover_episodes(queued | _episode_stages(in_workers))
    for plan in recovery:
        send(plan)
    plan = control_watchdog.watchdog(_steps(in_workers), _gpu_queue_depth())
    send(plan)
    return {"resent": plan.train, "ticked": plan.tick, "restarted": plan.start, "episodes": report,
            "runtimes_removed": control_watchdog.sweep_runtimes(),
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


def _tasks_in_workers() -> list[tuple[str, list]]:
    """(task name, args) of every task a live worker is running or has reserved."""
    from app.celery import app as celery_app

    inspect = celery_app.control.inspect(timeout=2.0)
    seen: list[tuple[str, list]] = []
    for listing in (inspect.active() or {}, inspect.reserved() or {}):
        for tasks in listing.values():
            seen += [(task.get("name") or "", list(task.get("args") or [])) for task in tasks]
    return seen


def _steps(tasks: list[tuple[str, list]]) -> set[tuple[int, int]]:
    """(run_id, step) of the training tasks among `tasks`."""
    return {(int(args[0]), int(args[1])) for name, args in tasks if name == TRAIN_TASK and len(args) >= 2}


# Episode stage task -> the episode state it works on (app.control.lease.STAGE_STATES).
STAGE_TASKS = {"prepare.prepare_episode": "preparing", "rollout.run_episode": "running",
               "grade.grade_episode": "grading"}


def _episode_stages(tasks: list[tuple[str, list]]) -> set[tuple[str, int]]:
    """(stage state, episode id) of the episode stage tasks among `tasks`."""
    return {(STAGE_TASKS[name], int(args[0])) for name, args in tasks if name in STAGE_TASKS and args}


def _queued_episode_stages() -> set[tuple[str, int]]:
    """(stage state, episode id) of every episode stage message waiting on its queue.

    kombu's Redis transport keeps each queue as lists (one per priority level, as in
    `_gpu_queue_depth`) of JSON envelopes whose `headers.task` names the task and whose body is
    base64 JSON `[args, kwargs, embed]` (Celery message protocol 2).
    """
    r = get_redis()
    found: list[tuple[str, list]] = []
    for queue in ("prepare", "rollout", "grade"):
        for key in [queue, *(f"{queue}:{p}" for p in range(1, 10))]:
            for raw in r.lrange(key, 0, -1):
                try:
                    envelope = json.loads(raw)
                    args = json.loads(base64.b64decode(envelope["body"]))[0]
                    found.append((envelope["headers"]["task"], list(args)))
                except (ValueError, KeyError, TypeError, IndexError):
                    continue  # not a Celery protocol-2 message: nothing of ours
    return _episode_stages(found)
