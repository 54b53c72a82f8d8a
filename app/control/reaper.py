"""The reaper: episodes whose stage lease expired, and Redis state rebuilt from SQL.

Run by the watchdog (`app.tasks.control.watchdog`, every `watchdog_interval_s`), with what the
task layer saw in the broker: `queued`, the (stage state, episode id) of every episode stage
message waiting on a queue or reserved/running in a live worker (None when unknown).

`reap_expired_leases`: an episode in a stage state (`lease.STAGE_STATES`) of a running run whose
lease expired (or that never had one) is

* left alone, its lease extended, when it has no owner and its message is in `queued` (the
  queue is just slow);
* failed with the reason once it was re-dispatched `max_redeliveries` times already;
* otherwise re-dispatched: owner cleared, a fresh lease, `redeliveries` + 1, the session key of
  a lost rollout revoked, and the stage's message sent again.  A rollout re-dispatch starts
  the next attempt (its completions are kept apart, `Completion.attempt`).

Every write is a compare-and-set on (status, lease owner, expired), so a stage that renewed
its lease or finished in the meantime is never touched, and two watchdogs cannot both act.

`rebuild_redis_state`: when Redis lost its data (no `redis_state.MARKER_KEY`), every running run's
READY buffer, slot list and the cancel flags are written from SQL, and the messages of
stages no worker had claimed (all lost with Redis's queues) are sent again at once, without
counting a redelivery; on every pass a READY buffer that differs from the run's `ready`
episodes is rewritten, and missing cancel flags are set again.  It holds each run's tick lock
while it looks, so a tick that arrived meanwhile (the run's dirty mark) is sent again after.
"""
from __future__ import annotations

import datetime as dt
import logging

from sqlalchemy import or_, select, update

from app.config import get_settings
from app.control import lease, redis_state
from app.control.plan import Plan, celery_priority
from app.control.runs import stages_for
from app.control.stages import LEASE_LOST
from app.db import session_scope
from app.tables import Episode, Run, utcnow

log = logging.getLogger("turnstile.reaper")

# Stage state -> its queue (also the `Plan` field that sends it).
STAGE_QUEUES = {"preparing": "prepare", "running": "rollout", "grading": "grade"}


def _plan_for(stage: str, episode_id: int, run_priority: int) -> Plan:
    plan = Plan(priority=celery_priority(run_priority))
    getattr(plan, STAGE_QUEUES[stage]).append(episode_id)
    return plan


def _lease_condition(owner: str | None, now: dt.datetime):
    """The row still has the owner we saw and its lease is still expired."""
    held = Episode.lease_owner.is_(None) if owner is None else Episode.lease_owner == owner
    return held, or_(Episode.lease_expires_at.is_(None), Episode.lease_expires_at < now)


def reap_expired_leases(now: dt.datetime, queued: set[tuple[str, int]] | None) -> tuple[list[Plan], dict]:
    """Re-dispatch or fail the episodes of running runs whose stage lease expired.

    Returns the plans to send (one per re-dispatched episode, at its run's priority, plus a
    tick of each run with a failed episode) and a report `{"redispatched": [[id, stage], ...],
    "failed": [ids], "waiting": [ids]}`.
    """
    settings = get_settings()
    queued = queued or set()
    plans: list[Plan] = []
    report: dict = {"redispatched": [], "failed": [], "waiting": []}
    with session_scope() as s:
        rows = s.execute(
            select(Episode.id, Episode.run_id, Episode.status, Episode.lease_owner, Episode.redeliveries,
                   Run.priority)
            .join(Run, Run.id == Episode.run_id)
            .where(Run.status == "running", Episode.status.in_(lease.STAGE_STATES),
                   or_(Episode.lease_expires_at.is_(None), Episode.lease_expires_at < now))
            .order_by(Episode.id)
        ).all()
    for row in rows:
        held, expired = _lease_condition(row.lease_owner, now)
        where = (Episode.id == row.id, Episode.status == row.status, held, expired)
        if row.lease_owner is None and (row.status, row.id) in queued:
            with session_scope() as s:
                s.execute(update(Episode).where(*where).values(lease_expires_at=lease.expiry(now))
                          .execution_options(synchronize_session=False))
            report["waiting"].append(row.id)
            continue
        lost = f"worker {row.lease_owner}" if row.lease_owner else "its message, before any worker took it"
        if row.redeliveries >= settings.max_redeliveries:
            if _fail(row, now, lost, settings.max_redeliveries):
                report["failed"].append(row.id)
                plans.append(Plan(tick=[row.run_id]))
            continue
        values = {"lease_owner": None, "lease_expires_at": lease.expiry(now),
                  "redeliveries": Episode.redeliveries + 1, "updated_at": now}
        if row.status == "running":
            values["session_token_hash"] = None  # the lost attempt's harness may not call any more
        with session_scope() as s:
            won = s.execute(update(Episode).where(*where).values(**values)
                            .execution_options(synchronize_session=False)).rowcount == 1
        if won:
            log.warning("episode=%s event=redispatch stage=%s redelivery=%s lost=%s", row.id, row.status,
                        row.redeliveries + 1, lost)
            report["redispatched"].append([row.id, row.status])
            plans.append(_plan_for(row.status, row.id, row.priority))
    return plans, report


def _fail(row, now: dt.datetime, lost: str, limit: int) -> bool:
    """Fail an episode out of redeliveries (compare-and-set on its lease); release its runtime."""
    held, expired = _lease_condition(row.lease_owner, now)
    error = (f"{row.status} lost with {lost}: {LEASE_LOST} after {row.redeliveries} re-dispatches "
             f"(TURNSTILE_MAX_REDELIVERIES={limit})")
    with session_scope() as s:
        won = s.execute(
            update(Episode).where(Episode.id == row.id, Episode.status == row.status, held, expired)
            .values(status="failed", error=error, finished_at=now, updated_at=now, session_token_hash=None,
                    **lease.clear_values())
            .execution_options(synchronize_session=False)
        ).rowcount == 1
        ep = s.get(Episode, row.id)
        runtime = ep.runtime if won and row.status == "running" else None
        cfg = s.get(Run, row.run_id).run_config() if runtime else None
    if won:
        log.warning("episode=%s event=failed error=%s", row.id, error)
    if runtime:
        stages_for(cfg).release(runtime)
    return won


# --- Redis state ------------------------------------------------------------------------


def expected_redis_state(run_id: int) -> dict:
    """What SQL implies for run `run_id`'s Redis state: `ready` (READY buffer, oldest first),
    `free_slots` (rollout slots not held by a running episode), `running` (episode ids) and
    `cancelled` (episodes cancelled within `task_time_limit`, whose rollout may still be
    running somewhere and must see the flag)."""
    since = utcnow() - dt.timedelta(seconds=get_settings().task_time_limit)
    with session_scope() as s:
        run = s.get(Run, run_id)
        slots = run.run_config().scheduling.rollout_slots
        ready = s.scalars(select(Episode.id).where(Episode.run_id == run_id, Episode.status == "ready")
                          .order_by(Episode.prepared_at, Episode.id)).all()
        running = s.scalars(select(Episode.id).where(Episode.run_id == run_id, Episode.status == "running")).all()
        cancelled = s.scalars(select(Episode.id).where(Episode.run_id == run_id, Episode.status == "cancelled",
                                                       Episode.finished_at >= since)).all()
    return {"ready": list(ready), "free_slots": max(0, slots - len(running)), "running": list(running),
            "cancelled": list(cancelled)}


def rebuild_redis_state(queued: set[tuple[str, int]] | None) -> tuple[list[Plan], dict]:
    """Bring Redis back to what SQL implies (module docstring); returns plans to send and a report
    `{"lost": bool, "ready": [run ids rewritten], "flags": n set, "resent": [[id, stage], ...]}`."""
    lost = not redis_state.has_marker()
    queued = queued or set()
    report: dict = {"lost": lost, "ready": [], "flags": 0, "resent": []}
    plans: list[Plan] = []
    since = utcnow() - dt.timedelta(seconds=get_settings().task_time_limit)
    with session_scope() as s:
        runs = s.execute(select(Run.id, Run.status, Run.priority)
                         .where(Run.status.in_(("running", "cancelling")))).all()
        recent = s.scalars(select(Episode.id).where(Episode.status == "cancelled", Episode.finished_at >= since)
                           .order_by(Episode.id)).all()
    missing = redis_state.missing_cancel_flags(list(recent))
    for episode_id in missing:
        redis_state.flag_cancelled(episode_id)
    report["flags"] = len(missing)
    for run_id, status, priority in runs:
        if status != "running":
            continue
        with redis_state.run_lock(run_id) as held:
            if not held:
                continue  # a tick is changing the buffer right now; the next pass looks again
            want = expected_redis_state(run_id)
            if redis_state.ready_ids(run_id) != want["ready"]:
                redis_state.set_ready(run_id, want["ready"])
                report["ready"].append(run_id)
            if lost:
                redis_state.reset_slots(run_id, want["free_slots"], want["running"])
        if redis_state.is_dirty(run_id):
            # A tick that found the lock held here returned, leaving its dirty mark for the holder
            # (`scheduler.tick`); this pass does not tick, so it hands the mark on as a tick to send.
            plans.append(Plan(tick=[run_id]))
        if lost:
            resent = _resend_unclaimed(run_id, priority, queued)
            report["resent"] += resent
            plans += [_plan_for(stage, episode_id, priority) for episode_id, stage in resent]
    if lost:
        log.warning("event=redis_state_rebuilt runs=%s flags=%s resent=%s", [r[0] for r in runs], report["flags"],
                    report["resent"])
    redis_state.set_marker()
    return plans, report


def _resend_unclaimed(run_id: int, priority: int, queued: set[tuple[str, int]]) -> list[list]:
    """[episode id, stage] of the run's stages that no worker claimed and no queue holds: their
    messages were lost with Redis.  Their lease restarts; no redelivery is counted."""
    now = utcnow()
    with session_scope() as s:
        rows = s.execute(select(Episode.id, Episode.status).where(
            Episode.run_id == run_id, Episode.status.in_(lease.STAGE_STATES), Episode.lease_owner.is_(None))).all()
        out = []
        for episode_id, stage in rows:
            if (stage, episode_id) in queued:
                continue
            s.execute(update(Episode).where(Episode.id == episode_id, Episode.status == stage,
                                            Episode.lease_owner.is_(None))
                      .values(lease_expires_at=lease.expiry(now)).execution_options(synchronize_session=False))
            out.append([episode_id, stage])
    return out

