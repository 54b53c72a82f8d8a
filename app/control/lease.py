"""Stage leases: which worker process holds an episode's current stage, and until when.

A message can be lost (a worker killed with its prefetched or running task, Redis restarted
with its queues), so SQL, not the broker, says whether a stage is still being worked on.
The rule, for the stage states `STAGE_STATES` (preparing on the `prepare` queue, running on
`rollout`, grading on `grade`):

* Entering a stage state (the scheduler's dispatch, rollout → grading, the reaper's
  re-dispatch) writes `lease_owner = NULL`, `lease_expires_at = now + lease_ttl_s`
  (`dispatch_values`): the message has that long to reach a worker; the watchdog extends
  it while the message is visibly waiting on its queue or reserved by a live worker.
* The stage task claims the lease (`claim`, compare-and-set) before any work: it wins when
  the lease has no owner, or when its owner's lease expired (a takeover: one more
  `redeliveries`).  A task that finds a live lease of another owner is a duplicate message
  and does nothing.
* While the stage works, a `Heartbeat` thread renews the lease every `lease_renew_s`; it
  notices when the lease is no longer its own (`lost`).
* The stage's closing write requires `lease_owner` to be still its own, so a worker that lost
  its lease (taken over after it stalled) never overwrites its successor's work.
* The watchdog (`app.control.reaper`) re-dispatches an episode whose lease expired, at most
  `max_redeliveries` times, then fails it with the reason.
"""
from __future__ import annotations

import datetime as dt
import logging
import os
import secrets
import socket
import threading

from sqlalchemy import or_, update
from sqlalchemy.orm import Session

from app.config import get_settings
from app.db import session_scope
from app.tables import Episode, aware_utc, utcnow

log = logging.getLogger("turnstile.lease")

STAGE_STATES = ("preparing", "running", "grading")


def new_owner() -> str:
    """A lease owner id, unique per stage execution: `<host>:<pid>:<random hex>`."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def renew_interval_s() -> float:
    """Seconds between two renewals: `lease_renew_s`, or a third of `lease_ttl_s` when unset."""
    settings = get_settings()
    return settings.lease_renew_s or settings.lease_ttl_s / 3.0


def expiry(now: dt.datetime | None = None) -> dt.datetime:
    return (now or utcnow()) + dt.timedelta(seconds=get_settings().lease_ttl_s)


def dispatch_values(now: dt.datetime | None = None) -> dict:
    """Column values of an episode that has just entered a stage state: no owner yet, and
    `lease_ttl_s` for its message to reach a worker."""
    return {"lease_owner": None, "lease_expires_at": expiry(now)}


def clear_values() -> dict:
    """Column values of an episode that has left its stage (READY, or finished)."""
    return {"lease_owner": None, "lease_expires_at": None}


def claim(session: Session, episode_id: int, stage: str, owner: str, *, where: dict | None = None,
          **values) -> bool:
    """Take the lease of episode `episode_id` in stage state `stage` for `owner`; True if won.

    Wins when the stage has no owner, or its owner's lease expired (then `redeliveries` goes up
    by one, unless it already reached `max_redeliveries`: the reaper fails such an episode).
    `where` adds equality conditions (e.g. the attempt seen); `values` are written in the same
    UPDATE.  The caller commits.
    """
    row = session.get(Episode, episode_id, populate_existing=True)
    if row is None or row.status != stage:
        return False
    now = utcnow()
    conditions = [Episode.id == episode_id, Episode.status == stage]
    if row.lease_owner is None:
        conditions.append(Episode.lease_owner.is_(None))
    else:
        expires = aware_utc(row.lease_expires_at)
        if expires is not None and expires > now:
            return False  # a live holder: this message is a duplicate
        if row.redeliveries >= get_settings().max_redeliveries:
            return False  # out of redeliveries: the reaper fails the episode
        conditions += [Episode.lease_owner == row.lease_owner,
                       or_(Episode.lease_expires_at.is_(None), Episode.lease_expires_at < now)]
        values["redeliveries"] = Episode.redeliveries + 1
        log.warning("episode=%s event=lease_takeover stage=%s from=%s", episode_id, stage, row.lease_owner)
    for column, value in (where or {}).items():
        conditions.append(getattr(Episode, column) == value)
    result = session.execute(
        update(Episode).where(*conditions)
        .values(lease_owner=owner, lease_expires_at=expiry(now), updated_at=now, **values)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def renew(episode_id: int, stage: str, owner: str) -> bool:
    """Push the lease's expiry to now + `lease_ttl_s`; False when `owner` no longer holds it."""
    with session_scope() as s:
        result = s.execute(
            update(Episode)
            .where(Episode.id == episode_id, Episode.status == stage, Episode.lease_owner == owner)
            .values(lease_expires_at=expiry())
            .execution_options(synchronize_session=False)
        )
        return result.rowcount == 1


def holds(episode_id: int, owner: str) -> bool:
    """Whether `owner` is still the episode's lease owner (whatever its status now)."""
    with session_scope() as s:
        ep = s.get(Episode, episode_id)
        return ep is not None and ep.lease_owner == owner


class Heartbeat:
    """Renew a stage's lease from a daemon thread while the stage works (a context manager).

    `lost` turns True once a renewal finds the lease gone (taken over, or the episode left the
    stage: cancelled, failed).  A renewal that meets a database error is tried again every
    `RETRY_AFTER_ERROR_S` (logged once per outage), so the lease is renewed within about a second
    of the database's return instead of one renewal interval later; if renewals keep failing, the
    lease expires and the reaper re-dispatches the stage.
    """

    RETRY_AFTER_ERROR_S = 0.5

    def __init__(self, episode_id: int, stage: str, owner: str) -> None:
        self.episode_id, self.stage, self.owner = episode_id, stage, owner
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease:{episode_id}", daemon=True)

    def _run(self) -> None:
        interval = renew_interval_s()
        wait, failing = interval, False
        while not self._stop.wait(wait):
            try:
                if not renew(self.episode_id, self.stage, self.owner):
                    self.lost = True
                    log.warning("episode=%s event=lease_lost stage=%s owner=%s", self.episode_id, self.stage,
                                self.owner)
                    return
            except Exception:  # noqa: BLE001 - a database hiccup must not end the stage
                if not failing:
                    log.exception("episode=%s event=lease_renew_failed", self.episode_id)
                wait, failing = min(self.RETRY_AFTER_ERROR_S, interval), True
                continue
            if failing:
                log.warning("episode=%s event=lease_renewed_after_error", self.episode_id)
            wait, failing = interval, False

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
