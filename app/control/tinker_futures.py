"""Tinker futures: one SQL row per op the SDK polls for, moved only by compare-and-set.

The Tinker SDK sends an op (forward_backward, optim_step, sample ...), gets back a request id at
once and polls `retrieve_future` until the op's result is there.  Each op is a `TinkerFuture` row:

    create    the service writes it `pending` (idempotent on the SDK's request id: the SDK's retry
              of the same request, same `X-Idempotency-Key`, finds the first row, never a second)
    claim     the worker's Celery task takes it `pending -> running` under a lease; a running row
              whose lease expired (its worker died: kill -9, OOM) may be claimed once more, so
              `attempts` is 2 at most and an op runs at most twice, never twice at once
    complete  `running -> completed` with the SDK response's JSON
    fail      `pending | running -> failed` with {"error", "category"} (the SDK raises
              `RequestFailedError` with that message)
    reap      the watchdog's rule that no future stays pending or running for ever: an expired
              lease is re-sent once, then failed; a future not started within `pending_timeout_s`
              (its message was lost, or no worker serves the queue) is failed

Every transition is one `UPDATE ... WHERE id = :id AND status IN (...)`, so two workers that got
the same redelivered message cannot both run it (`app.transitions` does the same for runs).
The caller commits.
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.tables import TinkerFuture, aware_utc, utcnow

MAX_ATTEMPTS = 2  # the first claim, and one re-claim after a lost lease
# RequestErrorCategory values of the SDK (tinker.types.RequestErrorCategory).
USER, SERVER = "User", "Server"


class FutureConflict(ValueError):
    """A request id that is already the id of another tenant's, model's or op's future."""


def create(session: Session, *, model_id: str | None, request_id: str, op: str, payload: dict[str, Any],
           key_name: str = "", sampling_session_id: str | None = None, seq_id: int | None = None) -> TinkerFuture:
    """The `pending` future of request `request_id` (op `op` on model `model_id`), created now, or
    the row an earlier try of the same request created (its status as it is now).

    `payload` is the SDK request's JSON; `key_name` the API key that sent it (who may retrieve it).
    Raises `FutureConflict` when `request_id` already names a future of another key, model or op (the service answers 400).
    """
    existing = _by_request(session, request_id)
    if existing is None:
        row = TinkerFuture(request_id=request_id, key_name=key_name, model_id=model_id, op=op, payload=payload,
                           sampling_session_id=sampling_session_id, seq_id=seq_id, status="pending", attempts=0)
        try:
            with session.begin_nested():  # a race with a concurrent retry loses only this INSERT
                session.add(row)
                session.flush()
            return row
        except IntegrityError:
            existing = _by_request(session, request_id)
            if existing is None:
                raise
    if (existing.key_name, existing.model_id, existing.op) != (key_name, model_id, op):
        raise FutureConflict(f"request id {request_id!r} is already the id of another request")
    return existing


def _by_request(session: Session, request_id: str) -> TinkerFuture | None:
    return session.scalars(select(TinkerFuture).where(TinkerFuture.request_id == request_id)
                           .execution_options(populate_existing=True)).first()


def get(session: Session, request_id: str, *, key_name: str | None = None) -> TinkerFuture | None:
    """The future of `request_id` as stored now; None when there is none (or, with `key_name`,
    when it belongs to another key: a tenant cannot tell another's future from a missing one)."""
    row = _by_request(session, request_id)
    if row is None or (key_name is not None and row.key_name != key_name):
        return None
    return row


def claim(session: Session, future_id: int, *, lease_s: float) -> TinkerFuture | None:
    """Take future `future_id` to `running` with a lease of `lease_s` seconds; the row, or None
    when this caller did not win (it is running under a live lease, finished, failed, or out of
    attempts: the reaper fails such a row).

    Wins a `pending` row, or a `running` row whose lease expired while `attempts < MAX_ATTEMPTS`
    (the worker that held it is gone); `attempts` goes up by one either way.
    """
    now = utcnow()
    lost_lease = and_(TinkerFuture.status == "running", TinkerFuture.attempts < MAX_ATTEMPTS,
                      or_(TinkerFuture.lease_expires_at.is_(None), TinkerFuture.lease_expires_at < now))
    result = session.execute(
        update(TinkerFuture)
        .where(TinkerFuture.id == future_id, or_(TinkerFuture.status == "pending", lost_lease))
        .values(status="running", attempts=TinkerFuture.attempts + 1,
                lease_expires_at=now + dt.timedelta(seconds=lease_s), started_at=now)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        return None
    return session.get(TinkerFuture, future_id, populate_existing=True)


def renew(session: Session, future_id: int, *, attempt: int, lease_s: float) -> bool:
    """Push the lease of the running future `future_id`, claim number `attempt`, to now + `lease_s`;
    False when that claim no longer holds it (re-claimed after its lease expired, or finished)."""
    result = session.execute(
        update(TinkerFuture)
        .where(TinkerFuture.id == future_id, TinkerFuture.status == "running", TinkerFuture.attempts == attempt)
        .values(lease_expires_at=utcnow() + dt.timedelta(seconds=lease_s))
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def complete(session: Session, future_id: int, result: dict[str, Any], *, attempt: int | None = None) -> bool:
    """`pending | running -> completed` with `result` (the SDK response type's JSON); True if this
    call made the change.  `attempt`: only while that claim holds the row (a worker whose lease
    was taken over must not finish it)."""
    return _finish(session, future_id, "completed", attempt, result=result)


def fail(session: Session, future_id: int, error: dict[str, Any], *, attempt: int | None = None) -> bool:
    """`pending | running -> failed` with `error`: {"error": message, "category": USER | SERVER}
    (a missing category reads as SERVER).  True if this call made the change."""
    error = {"category": SERVER, **error}
    return _finish(session, future_id, "failed", attempt, error=error)


def _finish(session: Session, future_id: int, to: str, attempt: int | None, **values: Any) -> bool:
    conditions = [TinkerFuture.id == future_id, TinkerFuture.status.in_(("pending", "running"))]
    if attempt is not None:
        conditions.append(TinkerFuture.attempts == attempt)
    result = session.execute(
        update(TinkerFuture).where(*conditions)
        .values(status=to, finished_at=utcnow(), lease_expires_at=None, **values)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


@dataclass
class Reaped:
    """What `reap` did: futures to send again (their lease expired once) and futures it failed."""

    resend: list[tuple[int, str]] = field(default_factory=list)  # (future id, op)
    failed: list[int] = field(default_factory=list)


def reap(session: Session, now: dt.datetime, *, pending_timeout_s: float) -> Reaped:
    """Futures that would otherwise wait for ever: a `running` row whose lease expired is listed for
    a re-send (its next claim is its last) or, out of attempts, failed; a `pending` row older than
    `pending_timeout_s` is failed (no worker took its message).  The caller sends `resend` and commits."""
    out = Reaped()
    expired = session.scalars(select(TinkerFuture).where(
        TinkerFuture.status == "running",
        or_(TinkerFuture.lease_expires_at.is_(None), TinkerFuture.lease_expires_at < now))).all()
    for row in expired:
        if row.attempts < MAX_ATTEMPTS:
            out.resend.append((row.id, row.op))
            continue
        message = (f"the worker running this {row.op} was lost {row.attempts} times (its lease expired); "
                   "the op was not applied after its last start. Send it again")
        if _fail_expired(session, row, now, message):
            out.failed.append(row.id)
    cutoff = now - dt.timedelta(seconds=pending_timeout_s)
    stale = session.scalars(select(TinkerFuture).where(TinkerFuture.status == "pending",
                                                       TinkerFuture.created_at < cutoff)).all()
    for row in stale:
        waited = (now - aware_utc(row.created_at)).total_seconds()
        message = (f"this {row.op} was not started within {pending_timeout_s:g} s (waited {waited:.0f} s): no "
                   "worker took it from its queue. Check that the gpu and rollout workers run, then send it again")
        result = session.execute(
            update(TinkerFuture).where(TinkerFuture.id == row.id, TinkerFuture.status == "pending")
            .values(status="failed", finished_at=now, error={"error": message, "category": SERVER})
            .execution_options(synchronize_session=False))
        if result.rowcount == 1:
            out.failed.append(row.id)
    return out


def _fail_expired(session: Session, row: TinkerFuture, now: dt.datetime, message: str) -> bool:
    result = session.execute(
        update(TinkerFuture)
        .where(TinkerFuture.id == row.id, TinkerFuture.status == "running", TinkerFuture.attempts == row.attempts,
               or_(TinkerFuture.lease_expires_at.is_(None), TinkerFuture.lease_expires_at < now))
        .values(status="failed", finished_at=now, lease_expires_at=None,
                error={"error": message, "category": SERVER})
        .execution_options(synchronize_session=False))
    return result.rowcount == 1
