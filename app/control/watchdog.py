"""Backstop for lost work: re-send training steps whose trainer died, re-dispatch episode stages
whose lease expired and rebuild Redis state from SQL (`app.control.reaper`), tick running runs,
and delete runtime folders nobody will use again.  (Restarted engines are put back on their runs'
weights by `app.control.engine_resync`, in the same pass.)

Episode stages hold a lease on their row (`app.control.lease`); the reaper re-dispatches an
expired one, whatever lost it (a killed worker, a message lost with Redis).  Training
steps are acknowledged on start (a redelivery while a step still runs would train twice),
so a gpu worker killed mid-step loses its message; the step row stays `pending`/`training`.
Every `watchdog_interval_s` (settings) the task layer asks the workers what they are running
and how many messages wait on the gpu queue, and calls `watchdog` with the answers: a step that no
worker is running or holding, with nothing waiting on the gpu queue, is sent again — the
trainer resumes it from its last checkpoint (`app.training.steps`).
"""
from __future__ import annotations

import datetime as dt
import logging

from sqlalchemy import select

from app.config import get_settings
from app.control import reaper
from app.control.plan import Plan
from app.db import session_scope
from app.tables import Episode, Run, TrainingStep, aware_utc, utcnow

log = logging.getLogger("turnstile.watchdog")

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
        since = aware_utc(started_at or created_at)
        if (run_id, step) in in_workers or (now - since).total_seconds() < STEP_GRACE_S:
            continue
        orphans.append((run_id, step))
    return orphans


LIVE_EPISODE_STATES = ("preparing", "ready", "running", "grading")


def sweep_runtimes() -> list[str]:
    """Delete runtime folders that no live episode holds and no task can still be using.

    A worker killed mid-stage never releases its runtime, and a cancelled run's READY runtimes
    are never rolled out.  A folder is kept while a live episode names it, and otherwise for
    the Celery hard time limit (`task_time_limit`): no stage (a prepare still building it, a
    grade running in it) can hold it longer.  Returns the removed runtime ids.  Runs on the
    machine of the worker that calls it (runtimes live on the disk that prepared them).
    """
    from app.runtimes import cleanup_stale_runtimes

    with session_scope() as s:
        live = s.scalars(select(Episode.runtime).where(Episode.status.in_(LIVE_EPISODE_STATES),
                                                       Episode.runtime.is_not(None))).all()
    keep = [r["id"] for r in live if isinstance(r, dict) and r.get("id")]
    removed = cleanup_stale_runtimes(get_settings().task_time_limit, keep=keep)
    if removed:
        log.warning("event=runtimes_swept removed=%s", removed)
    return removed


def watchdog(in_workers: set[tuple[int, int]], queue_depth: int) -> Plan:
    """One pass: the orphaned steps to re-send, every running (or cancelling) run to tick, and
    the runs to start (again), one lease period plus one watchdog period after their creation or
    start: still `queued` (their start message was lost, e.g. with a Redis restart), or `running`
    without their instance list (`summary.instance_ids`: the start failed halfway, its worker was
    killed, or it met a full disk or a dropped connection).  A control worker starts a run within
    seconds, and starting is one restartable step guarded by the run's start lock
    (`runs.start_run`), so a re-send while a start is under way does nothing."""
    orphans = find_orphaned_steps(utcnow(), in_workers, queue_depth)
    for run_id, step in orphans:
        log.warning("run=%s step=%s event=resend reason=no worker holds the step", run_id, step)
    settings = get_settings()
    stuck_before = utcnow() - dt.timedelta(seconds=settings.lease_ttl_s + settings.watchdog_interval_s)
    with session_scope() as s:
        live = s.execute(select(Run.id, Run.status, Run.summary, Run.started_at)
                         .where(Run.status.in_(("running", "cancelling")), Run.kind != "tinker")).all()
        # A Tinker model's run has no episodes to schedule: the Tinker service drives it (app.tinker).
        unstarted = list(s.scalars(select(Run.id).where(Run.status == "queued", Run.kind != "tinker",
                                                        Run.created_at < stuck_before)))
    running = [run_id for run_id, _, _, _ in live]
    half_started = [run_id for run_id, status, summary, started_at in live
                    if status == "running" and (summary or {}).get("instance_ids") is None
                    and (started_at is None or aware_utc(started_at) < stuck_before)]
    for run_id in unstarted:
        log.warning("run=%s event=restart reason=still queued; its start message was lost", run_id)
    for run_id in half_started:
        log.warning("run=%s event=restart reason=running without its instance list; its start did not finish",
                    run_id)
    return Plan(train=orphans, tick=running, start=unstarted + half_started)


def recover_episodes(queued: set[tuple[str, int]] | None) -> tuple[list[Plan], dict]:
    """Rebuild Redis state from SQL, then re-dispatch or fail episodes whose stage lease expired.

    `queued`: (stage state, episode id) of every episode stage message waiting on a queue or
    held by a live worker (None when unknown).  Returns the plans to send and a report
    (`{"redis": rebuild report, "leases": reap report}`).
    """
    plans, rebuilt = reaper.rebuild_redis_state(queued)
    reaped, leases = reaper.reap_expired_leases(utcnow(), queued)
    return plans + reaped, {"redis": rebuilt, "leases": leases}
