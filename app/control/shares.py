"""Weighted fair shares of the deployment's rollout capacity across the runs that want it.

Every run's rollouts go to the one `rollout` queue, whose workers run `rollout_capacity` episodes at
once (`TURNSTILE_ROLLOUT_CAPACITY`, default `TURNSTILE_ROLLOUT_CONCURRENCY`: one rollout host).
Celery serves that queue by priority, then first in, first out, so a run that keeps more messages
there than the workers can take would hold every other run of its priority or lower behind it.
The scheduler therefore caps each run's rollouts in flight at its share of the capacity
(`allowance`): weighted max-min fairness (water-filling; Demers, Keshav and Shenker, "Analysis and
Simulation of a Fair Queueing Algorithm", SIGCOMM 1989, the allocation deficit round-robin
converges to, Shreedhar and Varghese, SIGCOMM 1995) over each run's `scheduling.share`, where a
run never gets more than it can use now (its demand: `rollout_slots`, or fewer episodes left).

A run whose share shrinks (another run started) is not preempted: it dispatches nothing until its
rollouts in flight fall below its new share, so the shares hold again within one turnover of its
slots.  A run alone on the deployment keeps its `rollout_slots` as before (no cap from here).
Every run wanting rollouts gets at least one slot, so a share rounding to zero never starves it.

Training steps need no share: a run has at most one step on the `gpu` queue at a time, sent at the
same priority as every other run's, so the trainer takes runs' steps in turn, first in, first out.
"""
from __future__ import annotations

import math

from pydantic import ValidationError
from sqlalchemy import func, select

from app.config import get_settings
from app.runconfig import Scheduling
from app.tables import Episode, Run

# Episodes a run still has to roll out (or is rolling out): what its demand counts.
WANTING = ("queued", "preparing", "ready", "running")


def water_fill(capacity: int, demands: dict[int, int], weights: dict[int, float]) -> dict[int, int]:
    """Weighted max-min fair integer shares of `capacity` slots.

    Args:
        capacity: slots to share (>= 0).
        demands: run id -> slots it can use now (>= 0); a run with 0 gets 0.
        weights: run id -> its weight (> 0; a missing id weighs 1).

    Returns:
        run id -> slots, each at most its demand and at least 1 when its demand is positive (so the
        sum may exceed `capacity` when more runs want slots than there are).  Runs whose demand is
        below their weighted share get their demand; the rest split what is left in proportion to
        their weights, the fractions going by largest remainder (ties: the lower run id, the older
        run).
    """
    out = {rid: 0 for rid in demands}
    left = float(max(0, capacity))
    open_ = {rid for rid, d in demands.items() if d > 0}
    while open_:
        total = sum(weights.get(rid, 1.0) for rid in open_)
        fair = {rid: left * weights.get(rid, 1.0) / total for rid in open_}
        sated = {rid for rid in open_ if demands[rid] <= fair[rid]}
        if not sated:
            break
        for rid in sated:
            out[rid] = demands[rid]
            left -= demands[rid]
        open_ -= sated
    if open_:
        total = sum(weights.get(rid, 1.0) for rid in open_)
        fair = {rid: left * weights.get(rid, 1.0) / total for rid in open_}
        for rid in open_:
            out[rid] = math.floor(fair[rid])
        spare = int(round(left)) - sum(out[rid] for rid in open_)
        for rid in sorted(open_, key=lambda r: (-(fair[r] - math.floor(fair[r])), r))[:max(0, spare)]:
            out[rid] += 1
        for rid in open_:
            out[rid] = max(1, min(out[rid], demands[rid]))
    return out


def _wants(s) -> tuple[dict[int, int], dict[int, float]]:
    """(demands, weights) of the running runs: one query for their scheduling sections, one grouped
    count of their unfinished episodes.  Only `scheduling` is validated (it fills the defaults), not
    the whole config: the scheduler asks on every tick."""
    runs: dict[int, Scheduling] = {}
    for run_id, config in s.execute(select(Run.id, Run.config).where(Run.status == "running")):
        try:
            runs[run_id] = Scheduling.model_validate((config or {}).get("scheduling") or {})
        except ValidationError:  # a stored config that no longer validates fails its own run, not the others
            continue
    left = dict(s.execute(select(Episode.run_id, func.count()).where(Episode.run_id.in_(list(runs)),
                                                                     Episode.status.in_(WANTING))
                          .group_by(Episode.run_id)).all()) if runs else {}
    demands = {rid: min(sched.rollout_slots, int(left.get(rid, 0))) for rid, sched in runs.items()}
    return demands, {rid: sched.share for rid, sched in runs.items()}


def allowance(s, run_id: int) -> int | None:
    """Run `run_id`'s rollouts-in-flight cap on the shared rollout workers (asked from its own
    tick), or None when no other running run wants rollouts now (the run then keeps its
    `rollout_slots`)."""
    demands, weights = _wants(s)
    if run_id not in demands or not any(d > 0 for rid, d in demands.items() if rid != run_id):
        return None
    demands[run_id] = max(1, demands[run_id])  # its tick may be about to draw groups
    return water_fill(get_settings().rollout_capacity, demands, weights)[run_id]


def allowances(s) -> dict[int, int | None]:
    """Every running run's cap as it stands (what the dashboard shows): run id -> slots, or None for
    all of them when fewer than two runs want rollouts now."""
    demands, weights = _wants(s)
    if sum(1 for d in demands.values() if d > 0) < 2:
        return dict.fromkeys(demands)
    return water_fill(get_settings().rollout_capacity, demands, weights)
