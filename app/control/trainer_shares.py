"""Fair turns on the trainer: a Tinker op yields to the runs that have had less of it, per share.

The gpu queue's trainer serves two kinds of work.  An RL run sends one training step at a time
(`app.control.scheduler`), but a Tinker client sends ops back to back (up to its key's
`max_inflight`), so first in, first out it would hold the trainer as long as it keeps sending,
with an RL run's step waiting behind its burst.

Each gpu task therefore records the trainer seconds it used, per run, over the last
`trainer_share_window_s` (`record`; a Redis sorted set per run, scored by end time).  Before a
Tinker op claims its future, `should_yield` compares its run's seconds per unit of
`scheduling.share` (the weight the rollout workers' fair share uses, `app.control.shares`) with
those of every other run waiting for the trainer now:

* an RL run (`running`) with a training step `pending`;
* another Tinker model with a gpu future `pending` and none `running` (its next op can run).

The op yields (its task retries after `YIELD_S`, so the waiting work on the queue goes first)
when some waiting run has had fewer seconds per share.  This is least-attained-service-first by
weighted virtual time (Demers, Keshav and Shenker, "Analysis and Simulation of a Fair Queueing
Algorithm", SIGCOMM 1989) at the granularity of one op or step: while both keep the trainer
busy, its seconds split in proportion to the shares, to within one step.  RL steps never yield
(one message per run; the run's rollouts wait on it).  An op yields at most `MAX_YIELDS` times,
so a waiting run whose message was lost cannot starve it.
"""
from __future__ import annotations

import logging
import time
import uuid

from pydantic import ValidationError
from redis.exceptions import RedisError
from sqlalchemy import exists, select
from sqlalchemy.orm import Session, aliased

from app.config import get_settings
from app.redis_client import get_redis
from app.tables import Run, TinkerFuture, TinkerModel, TrainingStep

log = logging.getLogger(__name__)

YIELD_S = 0.2     # a yielding op's retry delay: long enough for the worker to take the next message
MAX_YIELDS = 50   # ~10 s of yielding at most, then it runs whoever waits
NOT_TRAINER_OPS = ("sample", "create_model")  # Tinker futures that never reach the gpu queue


def _key(run_id: int) -> str:
    return f"turnstile:trainer:usage:{int(run_id)}"


def forget(run_id: int) -> None:
    """Drop run `run_id`'s trainer usage: a new run of an id an earlier database used (run ids
    restart at 1) must not inherit that run's turns."""
    get_redis().delete(_key(run_id))


def record(run_id: int, seconds: float, *, now: float | None = None) -> None:
    """Add `seconds` (float, >= 0) of trainer time that run `run_id` used, ending at `now` (Unix
    seconds, default the clock's); entries older than the window are dropped."""
    now = time.time() if now is None else now
    window = get_settings().trainer_share_window_s
    pipe = get_redis().pipeline()
    pipe.zadd(_key(run_id), {f"{max(0.0, float(seconds)):.6f}:{uuid.uuid4().hex[:8]}": now})
    pipe.zremrangebyscore(_key(run_id), "-inf", now - window)
    pipe.expire(_key(run_id), int(window * 2) + 1)
    try:
        pipe.execute()
    except RedisError as exc:  # the accounting must never fail the step or op it follows
        log.warning("run=%s event=trainer_usage_not_recorded seconds=%.3f error=%s", run_id, seconds, exc)


def usage(run_ids: list[int], *, now: float | None = None) -> dict[int, float]:
    """Run id -> trainer seconds it used in the window ending at `now`."""
    now = time.time() if now is None else now
    since = now - get_settings().trainer_share_window_s
    pipe = get_redis().pipeline()
    for rid in run_ids:
        pipe.zrangebyscore(_key(rid), since, "+inf")
    return {rid: sum(float(m.split(b":", 1)[0]) for m in members)
            for rid, members in zip(run_ids, pipe.execute(), strict=True)}


def waiting_runs(s: Session, exclude_run_id: int) -> list[int]:
    """Ids of the other runs waiting for the trainer now (module docstring), ascending."""
    rl = select(TrainingStep.run_id).join(Run, Run.id == TrainingStep.run_id).where(
        TrainingStep.status == "pending", Run.status == "running", Run.id != exclude_run_id)
    busy = aliased(TinkerFuture)
    running = exists().where(busy.model_id == TinkerModel.id, busy.status == "running",
                             busy.op.not_in(NOT_TRAINER_OPS))
    tinker = select(TinkerModel.run_id).join(TinkerFuture, TinkerFuture.model_id == TinkerModel.id).where(
        TinkerFuture.status == "pending", TinkerFuture.op.not_in(NOT_TRAINER_OPS),
        TinkerModel.run_id != exclude_run_id, ~running)
    return sorted(set(s.scalars(rl).all()) | set(s.scalars(tinker).all()))


def _share(run: Run | None) -> float:
    try:
        return float(run.run_config().scheduling.share) if run is not None else 1.0
    except ValidationError:  # a stored config that no longer validates weighs the default
        return 1.0


def should_yield(s: Session, run_id: int, *, now: float | None = None) -> bool:
    """Whether run `run_id`'s next Tinker op should let a waiting run have the trainer first: some
    run in `waiting_runs` has used fewer trainer seconds per unit of its `scheduling.share`."""
    others = waiting_runs(s, run_id)
    if not others:
        return False
    try:
        used = usage([run_id, *others], now=now)
    except RedisError as exc:  # no accounting to go by: first in, first out, as without shares
        log.warning("run=%s event=trainer_usage_unread error=%s", run_id, exc)
        return False
    mine = used[run_id] / _share(s.get(Run, run_id))
    return any(used[rid] / _share(s.get(Run, rid)) < mine for rid in others)
