"""`control` queue: start, tick and cancel runs; the watchdog; a failed training step's errback."""
from __future__ import annotations

import base64
import json
import logging

from billiard.exceptions import WorkerLostError
from celery import shared_task
from celery.signals import beat_init

from app.config import get_settings
from app.control import engine_pauses, engine_resync, runs, scheduler, watchdog as control_watchdog
from app.db import session_scope
from app.retry import TRANSIENT_ERRORS, is_transient, retry_transient
from app.tables import TrainingStep, utcnow
from app.redis_client import get_redis, held_lock
from app.transitions import transition
from app.tasks.send import send, send_train_step

log = logging.getLogger("turnstile.tasks.control")

TRAIN_TASK = "gpu.train_step"


@shared_task(name="control.start_run", acks_late=True)
def start_run(run_id: int) -> None:
    send(runs.start_run(run_id))


@shared_task(name="control.tick", acks_late=True)
def tick(run_id: int) -> None:
    _tick_through_blips(run_id)


@shared_task(name="control.cancel_run", acks_late=True)
def cancel_run(run_id: int) -> None:
    _tick_through_blips(run_id)


def _tick_through_blips(run_id: int) -> None:
    """Tick the run and send its plan, again through a database or Redis blip (for up to one
    lease period): a tick is idempotent (the run lock, compare-and-set dispatches), and a tick
    lost to a Redis restart would leave the run idle until the watchdog's next pass."""
    retry_transient(lambda: send(scheduler.tick(run_id)), deadline_s=get_settings().lease_ttl_s,
                    what=f"run {run_id} tick")


WATCHDOG_LOCK = "turnstile:watchdog:lock"


@shared_task(name="control.watchdog", acks_late=True)
def watchdog() -> dict:
    """Periodic backstop (Celery beat): rebuild Redis state from SQL, re-dispatch episode stages
    whose lease expired, re-send orphaned training steps, tick running runs, sweep runtimes, put
    restarted engines back on their run's newest weights, resume vLLM engines a weight update
    left paused past `weight_pause_timeout_s` (`app.control.engine_pauses`).

    One pass at a time across every process (the Redis lock `WATCHDOG_LOCK`): a second beat, or a
    message redelivered while a pass runs, finds the lock taken and returns `{"skipped": ...}`,
    so two passes never both see a lost step as lost and send it twice.
    """
    with held_lock(WATCHDOG_LOCK, get_settings().watchdog_interval_s) as held:
        if not held:
            return {"skipped": "another watchdog pass is under way"}
        return _watchdog_pass()


def _watchdog_pass() -> dict:
    # The queues first, then the workers: a message moves from its queue to a worker, so reading
    # in that order sees it at least once (read the other way round, it can slip between the two).
    queued = _queued_episode_stages()
    gpu_depth = _gpu_queue_depth()
    in_workers = _tasks_in_workers()
    recovery, report = control_watchdog.recover_episodes(queued | _episode_stages(in_workers))
    for plan in recovery:
        send(plan)
    plan = control_watchdog.watchdog(_steps(in_workers), gpu_depth)
    send(plan)
    return {"tinker_futures": _reap_tinker_futures(), "resent": plan.train, "ticked": plan.tick, "restarted": plan.start, "episodes": report,
            "runtimes_removed": control_watchdog.sweep_runtimes(),
            "engines_resynced": engine_resync.resync_engines(), "engines_resumed": engine_pauses.resume_stale_pauses()}


def _reap_tinker_futures() -> dict:
    """Tinker futures whose worker was lost are sent once more, then failed; those no worker started
    within `tinker_pending_timeout_s` are failed (`app.control.tinker_futures.reap`); the runs of
    models whose client went away end (`app.control.tinker_models.finish_idle`)."""
    from app.control import tinker_futures, tinker_models
    from app.tasks.send import send_tinker_future

    settings = get_settings()
    with session_scope() as s:
        reaped = tinker_futures.reap(s, utcnow(), pending_timeout_s=settings.tinker_pending_timeout_s)
    for future_id, op in reaped.resend:
        send_tinker_future(future_id, op)
    with session_scope() as s:  # models whose client is gone: their runs end
        finished = tinker_models.finish_idle(s, utcnow(), session_timeout_s=settings.tinker_session_timeout_s)
    return {"resent": [fid for fid, _ in reaped.resend], "failed": reaped.failed, "models_finished": finished}


@shared_task(name="control.step_failed")
def step_failed(request, exc, traceback, run_id: int, step: int) -> None:
    """Errback of a training step: record a real failure so the run fails with the reason.

    A lost worker (its pool child killed: `WorkerLostError`) is not a failure of the step:
    the step stays `training`, the watchdog re-sends it once no worker holds it, and the
    trainer resumes from its newest checkpoint.  Nor is a dropped database or Redis connection
    (`app.retry.is_transient`): the step counts it (`metrics.transient_retries`, with
    `metrics.transient_error`) and is sent again once the database answers (waiting up to one
    lease period; past it the step is left to the watchdog); only past `max_redeliveries` such
    re-sends does it fail.
    """
    if isinstance(exc, WorkerLostError):
        return
    settings = get_settings()
    error = f"{type(exc).__name__}: {exc}"
    if is_transient(exc):
        try:
            retries = retry_transient(lambda: _count_transient_retry(run_id, step, error),
                                      deadline_s=settings.lease_ttl_s, what=f"run {run_id} step {step} retry")
        except TRANSIENT_ERRORS:
            log.warning("run=%s step=%s event=step_left_to_watchdog error=%s", run_id, step, error[:200])
            return
        if retries is None:
            return  # the step or its run is gone
        if retries <= settings.max_redeliveries:
            log.warning("run=%s step=%s event=step_resent retries=%s error=%s", run_id, step, retries, error[:200])
            send_train_step(run_id, step)
            return
        error = f"{error} (after {retries - 1} re-sends for transient errors)"
    with session_scope() as s:
        row = s.query(TrainingStep).filter_by(run_id=run_id, step=step).one_or_none()
        if row is not None:
            transition(s, TrainingStep, row.id, "failed", error=error, finished_at=utcnow())
    send(scheduler.tick(run_id))


def _count_transient_retry(run_id: int, step: int, error: str) -> int | None:
    """Add one to the step's `metrics.transient_retries` (recording `error`); the new count, or
    None when the step is not unfinished (gone, completed or failed meanwhile)."""
    with session_scope() as s:
        row = s.query(TrainingStep).filter_by(run_id=run_id, step=step).one_or_none()
        if row is None or row.status not in ("pending", "training"):
            return None
        retries = int((row.metrics or {}).get("transient_retries", 0)) + 1
        row.metrics = {**(row.metrics or {}), "transient_retries": retries, "transient_error": error[:1000]}
        return retries


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


# Connected here, not in app/celery.py, which the task modules import: beat imports the task
# modules (the app's `include`) before it sends `beat_init`.
@beat_init.connect
def _run_watchdog_in_beat(**_kwargs) -> None:
    """The beat process runs the watchdog's pass itself, at its start and every
    `watchdog_interval_s`, besides sending `control.watchdog` on its schedule.

    A message waits for a free child of a cpu worker, and on a worker busy with long grades it
    waits minutes; this pass needs no worker, and a restarted beat makes one at once.  The pass
    holds the watchdog lock (`app.tasks.control.WATCHDOG_LOCK`), so it and a worker's pass (or a
    second beat's) never run together.
    """
    import logging
    import threading
    import time

    log = logging.getLogger("turnstile.beat")
    interval = get_settings().watchdog_interval_s

    def passes() -> None:
        # Fixed-rate: a pass starts every `interval` from beat's start, however long the last one
        # took (its `inspect` alone waits 2 s), so a lost stage is found at most one period after
        # its lease expired.
        stop = threading.Event()
        next_at = time.monotonic()
        while True:
            next_at += interval
            try:
                report = watchdog()
                log.info("event=watchdog_pass in=beat report=%s", {k: report.get(k) for k in (
                    "skipped", "resent", "restarted")})
            except Exception:  # noqa: BLE001 - a pass that meets a database or Redis outage is tried next period
                log.exception("event=watchdog_pass_failed in=beat")
            next_at = max(next_at, time.monotonic())  # a pass longer than a period: the next one at once
            stop.wait(next_at - time.monotonic())

    threading.Thread(target=passes, name="watchdog", daemon=True).start()
