"""A GRPO group's state in words, computed in one place for the run page, the episode page and the API.

A group's `Group.status` says what the scheduler decided, not what the trainer did: a group is
`trained` as soon as a step is created for it, minutes before the gpu worker runs that step.
So the state shown joins the group with its step's row (`TrainingStep.status`):

    waiting for step N    not yet taken by a step (sampling, judged, accepted), or taken by
                          step N while that step waits on the gpu queue
    training in step N    taken by step N, which the trainer is running
    trained in step N     taken by step N, which completed
    set aside: <reason>   filtered (dynamic sampling), dropped as stale or rejected
    not trained: <why>    step N failed, the run ended first, or every step has its groups

N is the step that trained the group, or that will: `Group.step` once a step took it; before
that, the step its episodes were sampled for (`Episode.step`), or the next step not yet
created when that one already has its groups.  An episode's step is its group's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.tables import Episode, Group, Run, TrainingStep
from app.transitions import TERMINAL

# state: a group a step has taken, by that step's status
_TAKEN = {"pending": "waiting", "training": "training", "completed": "trained", "failed": "not_trained"}
SET_ASIDE = ("filtered", "dropped", "rejected")
GROUP_STATES = ("sampling", "done", "waiting", "training", "trained", "set_aside", "not_trained")


@dataclass
class RunSteps:
    """What a group's state needs of its run: kind, status, the configured number of steps, and
    each created step's (status, error) by step number."""

    kind: str
    status: str
    steps_total: int
    steps: dict[int, tuple[str, str | None]] = field(default_factory=dict)


def run_steps(s: Session, run: Run) -> RunSteps:
    """The `RunSteps` of `run`, read from its `TrainingStep` rows (one query)."""
    rows = s.execute(select(TrainingStep.step, TrainingStep.status, TrainingStep.error)
                     .where(TrainingStep.run_id == run.id)).all()
    return RunSteps(run.kind, run.status, int((run.config or {}).get("steps") or 0),
                    {st: (status, error) for st, status, error in rows})


def group_state(ctx: RunSteps, row: Group | None, planned_step: int) -> dict:
    """The state of one group: {"state" (one of `GROUP_STATES`), "step" (int, or None when no step
    will train it), "label" (the words every page and the API show), "reason" (the scheduler's or
    the step's reason, or None)}.

    `row`: the group's `Group` row (None: the scheduler has not written one); `planned_step`: the
    step its episodes were sampled for (`Episode.step`)."""
    status = row.status if row is not None else "open"
    reason = row.reason if row is not None else None
    if ctx.kind != "train":
        if status == "done":
            return _state("done", None, "done", reason)
        return _state("sampling", None, "sampling", reason)
    if status in SET_ASIDE:
        return _state("set_aside", row.step, f"set aside: {reason or status}", reason)
    if status == "trained" and row.step is not None:
        n = row.step
        step_status, error = ctx.steps.get(n, ("pending", None))
        state = _TAKEN.get(step_status, "waiting")
        if state == "not_trained":
            return _state(state, n, f"not trained: step {n} failed" + (f": {error}" if error else ""), error)
        return _state(state, n, {"waiting": f"waiting for step {n}", "training": f"training in step {n}",
                                 "trained": f"trained in step {n}"}[state], reason)
    # not taken by a step yet: open, complete, accepted, or closed when the run ended (done)
    n = max(planned_step, len(ctx.steps))
    if status == "done" or ctx.status in TERMINAL:
        why = reason or f"the run {ctx.status} before a step took it"
        return _state("not_trained", None, f"not trained: {why}", reason)
    if ctx.steps_total and n >= ctx.steps_total:
        return _state("not_trained", None, f"not trained: all {ctx.steps_total} steps have their groups", reason)
    return _state("waiting", n, f"waiting for step {n}", reason)


def _state(state: str, step: int | None, label: str, reason: str | None) -> dict:
    return {"state": state, "step": step, "label": label, "reason": reason}


def group_states(s: Session, run: Run) -> dict[int, dict]:
    """`group_state` of every group of `run` by group index, in three queries (the episodes
    table, the API's episode list): a group's planned step is its episodes' smallest `Episode.step`."""
    planned = dict(s.execute(select(Episode.group_index, func.min(Episode.step)).where(Episode.run_id == run.id)
                             .group_by(Episode.group_index)).all())
    rows = {g.group_index: g for g in s.scalars(select(Group).where(Group.run_id == run.id))}
    ctx = run_steps(s, run)
    return {index: group_state(ctx, rows.get(index), step) for index, step in planned.items()}


def episode_state(s: Session, episode: Episode) -> dict:
    """`group_state` of `episode`'s group (the API's one-episode view)."""
    run = episode.run
    row = s.scalar(select(Group).where(Group.run_id == run.id, Group.group_index == episode.group_index))
    planned = s.scalar(select(func.min(Episode.step)).where(Episode.run_id == run.id,
                                                            Episode.group_index == episode.group_index))
    return group_state(run_steps(s, run), row, planned if planned is not None else episode.step)
