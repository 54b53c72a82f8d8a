"""The autoscaling signal of the CPU worker groups: work queued and leased, read from SQL.

KEDA's Redis list scaler counts only the messages still waiting in a list, not tasks a Celery
worker has already reserved or is running, so it scales workers down under running work
(https://github.com/kedacore/keda/issues/6719, https://github.com/kedacore/keda/issues/3674).
Turnstile's stage leases (`app.control.lease`) record every stage exactly: an episode in a
stage state with `lease_owner` NULL has a message waiting for a worker (queued), one with an
owner is being worked on (leased).  Both count as work for the pods serving that stage.

A pod serving `rollout` also holds the READY runtimes it prepared (their rollout is routed to
that pod's own queue), so `ready` episodes count for it too: scaling it down would drop them.

KEDA's PostgreSQL scaler runs the query on every polling interval and sets the replicas to
`ceil(value / targetQueryValue)` (https://keda.sh/docs/latest/scalers/postgresql/); the
target is the Celery processes one pod runs for those queues.
"""
from __future__ import annotations

from app.control.lease import STAGE_STATES
from app.tables import Episode

# Episode states that are work for the pods of each CPU queue (the stage states of
# app.control.lease, plus READY runtimes waiting on the pod that prepared them).
QUEUE_STATES: dict[str, tuple[str, ...]] = {
    "prepare": ("preparing",),
    "rollout": ("ready", "running"),
    "grade": ("grading",),
}
assert {s for states in QUEUE_STATES.values() for s in states} >= set(STAGE_STATES)


def states_of(queues: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """Episode states that are work for a worker group serving `queues` (empty for `control`)."""
    return tuple(s for q in queues for s in QUEUE_STATES.get(q, ()))


def work_query(queues: list[str] | tuple[str, ...]) -> str:
    """The SQL KEDA's PostgreSQL scaler runs for a worker group: one integer, the episodes whose
    stage the group's pods hold or will take (queued + leased).  Raises ValueError for a group
    without autoscaled queues (only `control`)."""
    states = states_of(queues)
    if not states:
        raise ValueError(f"queues {list(queues)} have no queued or leased episode work to scale on")
    quoted = ", ".join(f"'{s}'" for s in states)  # fixed names above, never user input
    return f"SELECT COUNT(*) FROM {Episode.__tablename__} WHERE status IN ({quoted})"
