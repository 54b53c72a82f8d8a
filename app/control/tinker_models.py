"""When a Tinker model's run ends: its SDK session went silent or was finished, and none of its ops is in flight.

A Tinker model's run (kind `tinker`) is `running` while a client holds it.  The SDK beats every
10 s (tinker/lib/internal_client_holder.py).  Once its session has been silent for
`tinker_session_timeout_s`, or its client finished it (`ServiceClient.close`), and the model has
no future pending or running, its run moves to `completed` (compare-and-set, `app.transitions`):
at the finish itself when nothing is in flight, else on a later watchdog pass.  It then no longer
counts toward its key's `max_models` nor holds the engines against a full fine-tune
(`app.control.tenancy`), and the service refuses new ops on it: its saved states load into a new
model (`load_state(path)`).
"""
from __future__ import annotations

import datetime as dt

from sqlalchemy import exists, or_, select
from sqlalchemy.orm import Session

from app.tables import Run, TinkerFuture, TinkerModel, TinkerSession
from app.transitions import transition


def finish_idle(s: Session, now: dt.datetime, *, session_timeout_s: float,
                session_id: str | None = None) -> list[int]:
    """Complete the runs of Tinker models whose session is finished (its client closed it) or
    silent past `session_timeout_s`, and that have nothing in flight; only session `session_id`'s
    when given.  Returns the ids of the runs this call completed.  The caller commits."""
    silent_since = now - dt.timedelta(seconds=session_timeout_s)
    in_flight = exists().where(TinkerFuture.model_id == TinkerModel.id,
                               TinkerFuture.status.in_(("pending", "running")))
    query = (select(Run.id).join(TinkerModel, TinkerModel.run_id == Run.id)
             .join(TinkerSession, TinkerSession.id == TinkerModel.session_id)
             .where(Run.kind == "tinker", Run.status == "running", ~in_flight,
                    or_(TinkerSession.finished_at.is_not(None), TinkerSession.heartbeat_at < silent_since)))
    if session_id is not None:
        query = query.where(TinkerSession.id == session_id)
    return [rid for rid in s.scalars(query).all() if transition(s, Run, rid, "completed", finished_at=now)]
