"""GRPO groups as the dashboard shows them: per step, each group's instance, rewards, advantages and fate.

A group is the `group_size` episodes of one task instance (`Episode.group_index`); its fate is
the scheduler's `Group` row (`app.control.scheduler`) joined with its step's row, in the words of
`app.api.group_state` (waiting for, training in, trained in step N; set aside; not trained).
Advantages are recomputed with the trainer's own function (`app.advantages.group_advantages`)
over the episodes a step trains (the completed ones), times the group's staleness weight,
exactly as `app.training.steps.step_sequences` does; they are shown only for groups a step
took (trained, or set aside for it, whose advantages are all 0 by construction).
"""
from __future__ import annotations

from collections import defaultdict

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.advantages import group_advantages
from app.api.group_state import RunSteps, group_state, run_steps
from app.tables import Episode, Group, Run, TaskInstance, TrainingStep
from app.transitions import TERMINAL

ADVANTAGE_SHOWN = ("trained", "filtered")


def reward_text(episodes: list[dict]) -> str:
    """The group's rewards in sample order: `1011` for 0/1 rewards, else `0.50 1.00 …`;
    `·` marks a sample still running, `×` one that ended without a reward (failed, cancelled)."""
    binary = all(e["reward"] in (None, 0.0, 1.0) for e in episodes)
    marks = []
    for e in episodes:
        if e["reward"] is None:
            marks.append("×" if e["status"] in TERMINAL else "·")
        else:
            marks.append(f"{e['reward']:.0f}" if binary else f"{e['reward']:.2f}")
    return ("" if binary else " ").join(marks)


def _advantages(members: list[dict], config: dict, weight: float) -> list[float | None]:
    training = (config or {}).get("training") or {}
    trained = [e for e in members if e["status"] == "completed"]
    values = group_advantages([e["reward"] for e in trained], training.get("advantage_mode", "mean"),
                              training.get("normalize_advantage_std", True))
    by_id = {e["id"]: v * weight for e, v in zip(trained, values)}
    return [by_id.get(e["id"]) for e in members]


def _group_view(index: int, members: list[dict], row: Group | None, instance: str | None, run: Run,
                ctx: RunSteps) -> dict:
    """`state` (app.api.group_state) names what happened to the group; `step` is the step that
    trained it or will (else the step its episodes were sampled for, to place it on the page)."""
    status = row.status if row is not None else None
    weight = row.weight if row is not None else 1.0
    shown = run.kind == "train" and status in ADVANTAGE_SHOWN
    advantages = _advantages(members, run.config, weight) if shown else [None] * len(members)
    samples = [{**e, "advantage": a} for e, a in zip(members, advantages)]
    planned = min(e["step"] for e in members) if members else 0
    state = group_state(ctx, row, planned)
    return {"index": index, "instance": instance, "status": status or "-", "state": state["state"],
            "label": state["label"], "reason": state["reason"],
            "step": state["step"] if state["step"] is not None else planned,
            "weight": weight, "rewards": reward_text(members), "samples": samples}


def _episode_rows(s: Session, run_id: int, group_indexes: list[int] | None = None) -> list[dict]:
    q = (select(Episode.id, Episode.group_index, Episode.sample_index, Episode.step, Episode.status, Episode.reward,
                Episode.resolved, TaskInstance.instance_id)
         .join(TaskInstance, TaskInstance.id == Episode.instance_id).where(Episode.run_id == run_id)
         .order_by(Episode.group_index, Episode.sample_index))
    if group_indexes is not None:
        q = q.where(Episode.group_index.in_(group_indexes))
    return [{"id": i, "group": g, "sample": k, "step": st, "status": status, "reward": reward, "resolved": resolved,
             "instance": name} for i, g, k, st, status, reward, resolved, name in s.execute(q)]


def run_groups(s: Session, run: Run) -> list[dict]:
    """The run's groups by step: [{step, step_status, groups: [group view]}], steps in order.

    A group belongs to the step that took it (`Group.step`: trained or set aside for it);
    a group no step took (open, accepted, dropped, rejected) to the step its episodes were
    sampled for (`Episode.step`).  Group view: {index, instance, status, label, reason, step,
    weight, rewards (`reward_text`), samples: [{id, sample, status, reward, resolved, advantage}]}.
    """
    members: dict[int, list[dict]] = defaultdict(list)
    for e in _episode_rows(s, run.id):
        members[e["group"]].append(e)
    rows = {g.group_index: g for g in s.scalars(select(Group).where(Group.run_id == run.id))}
    ctx = run_steps(s, run)
    by_step: dict[int, list[dict]] = defaultdict(list)
    for index, eps in sorted(members.items()):
        view = _group_view(index, eps, rows.get(index), eps[0]["instance"], run, ctx)
        by_step[view["step"]].append(view)
    return [{"step": step, "step_status": ctx.steps.get(step, (None, None))[0], "groups": groups}
            for step, groups in sorted(by_step.items())]


def episode_group(s: Session, episode: Episode) -> dict:
    """The episode's group (a `run_groups` group view) and whether its sequences were trained.

    `trained` is True only when the group was trained by a completed step that lists this
    episode; `why_not` says otherwise why its sequences were not (or not yet) trained.
    """
    run = episode.run
    row = s.scalar(select(Group).where(Group.run_id == run.id, Group.group_index == episode.group_index))
    members = _episode_rows(s, run.id, [episode.group_index])
    name = members[0]["instance"] if members else None
    view = _group_view(episode.group_index, members, row, name, run, run_steps(s, run))
    step = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run.id, TrainingStep.step == view["step"]))
    trained = (run.kind == "train" and view["state"] == "trained" and step is not None
               and episode.id in (step.episode_ids or []))
    if trained:
        why_not = None
    elif run.kind != "train":
        why_not = f"{run.kind} runs are not trained"
    elif episode.status != "completed":
        why_not = f"the episode is {episode.status}: only completed episodes are trained"
    elif view["status"] == "trained" and step is not None:
        why_not = f"step {step.step} is {step.status}" + (f": {step.error}" if step.error else "")
    else:
        why_not = f"the group is {view['label']}"
    return {**view, "trained": trained, "why_not": why_not, "current": episode.id}

