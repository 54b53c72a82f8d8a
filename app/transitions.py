"""Compare-and-set state transitions for runs, episodes and training steps.

A transition is one `UPDATE … WHERE id = :id AND status IN (:allowed)`; the
affected row count says whether this caller won.  A redelivered Celery task that
finds its episode already past the expected state therefore does nothing, which
is what makes `acks_late` safe.
"""
from __future__ import annotations

from typing import Any, Iterable

from sqlalchemy import update
from sqlalchemy.orm import Session

from app.tables import Episode, Run, TrainingStep, utcnow

# The states no transition leaves, the same for runs and episodes (tests check it against the
# tables below: none of them is an allowed predecessor).  A training step ends in `STEP_TERMINAL`.
TERMINAL: tuple[str, ...] = ("completed", "failed", "cancelled")
STEP_TERMINAL: tuple[str, ...] = ("completed", "failed")

# Allowed predecessors of each target state.
RUN_TRANSITIONS: dict[str, tuple[str, ...]] = {
    "running": ("queued",),
    "cancelling": ("queued", "running"),
    "completed": ("running",),
    "failed": ("queued", "running", "cancelling"),
    "cancelled": ("queued", "running", "cancelling"),
}

EPISODE_TRANSITIONS: dict[str, tuple[str, ...]] = {
    "preparing": ("queued", "preparing"),  # preparing->preparing: a redelivered prepare retries
    "ready": ("preparing",),
    "running": ("ready", "running"),  # running->running: takeover of a dead worker's attempt
    "grading": ("running", "grading"),
    "completed": ("grading",),
    "failed": ("queued", "preparing", "ready", "running", "grading"),
    "cancelled": ("queued", "preparing", "ready", "running", "grading"),
}

STEP_TRANSITIONS: dict[str, tuple[str, ...]] = {
    "training": ("pending", "training"),
    "completed": ("training",),
    "failed": ("pending", "training"),
}

# A run may be cancelled from these states (the predecessors of `cancelling`).
RUN_CANCELLABLE: tuple[str, ...] = RUN_TRANSITIONS["cancelling"]

_TABLES = {Run: RUN_TRANSITIONS, Episode: EPISODE_TRANSITIONS, TrainingStep: STEP_TRANSITIONS}


class InvalidTransition(ValueError):
    """Raised for a target state the state machine does not know."""


def transition(
    session: Session,
    model: type[Run] | type[Episode] | type[TrainingStep],
    row_id: int,
    to: str,
    *,
    expect: Iterable[str] | None = None,
    where: dict[str, Any] | None = None,
    **values: Any,
) -> bool:
    """Move row `row_id` of `model` to status `to` if its status is an allowed predecessor.

    `expect` narrows the allowed predecessors further; `where` adds equality
    conditions (e.g. `{"attempts": 2}` so only the current attempt may finish).  Extra keyword `values` are
    written in the same UPDATE.  Returns True when this call made the change.
    The caller commits.  Raises `InvalidTransition` for an unknown target state.
    """
    table = _TABLES[model]
    if to not in table:
        raise InvalidTransition(f"{model.__name__}: unknown target state {to!r}")
    allowed = set(table[to])
    if expect is not None:
        allowed &= set(expect)
    if not allowed:
        return False
    if "updated_at" in model.__table__.c:
        values.setdefault("updated_at", utcnow())
    conditions = [model.id == row_id, model.status.in_(sorted(allowed))]
    for column, value in (where or {}).items():
        conditions.append(getattr(model, column) == value)
    result = session.execute(
        update(model)
        .where(*conditions)
        .values(status=to, **values)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1
