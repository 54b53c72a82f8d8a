"""What the run page shows, read from SQL as plain dicts: the run, its live aggregates, steps,
curves (`charts.py`), groups (`groups.py`), an eval's per-instance results (`compare.py`) and
the filtered episodes table.

Every value a template formats is computed here, with None for "not there (yet)", so a run
in any state (queued with no episode, a step still pending or training, a failed step)
renders: templates never reach into a step's metrics themselves.
"""
from __future__ import annotations

from sqlalchemy import Integer, cast, func, select
from sqlalchemy.orm import Session

from app.api.dashboard.charts import UPDATE_METRICS, metric, not_computed, step_charts
from app.api.dashboard.compare import eval_results
from app.api.dashboard.data import age, seconds_between
from app.api.dashboard.groups import run_groups
from app.api.group_state import group_states
from app.api.dashboard.heldout import heldout_view
from app.api.serialize import waiting_reason
from app.control.failure import failure_reason
from app.control.tinker_progress import progress as tinker_progress
from app.provenance import chosen_rows
from app.tables import EPISODE_STATES, Completion, Episode, Run, TaskInstance, TrainingStep, utcnow
from app.transitions import TERMINAL

# Steps-table columns: (heading, metric path, format).
STEP_COLUMNS = [("reward", "reward_mean", ".3f"), ("resolved", "resolved_rate", "rate"), ("loss", "loss", ".4f"),
                ("kl", "kl", ".2e"), ("grad norm", "grad_norm", ".3f"), ("tokens", "tokens_trained", "d"),
                ("step time", "step_time_s", "s")]


def step_rows(steps: list[TrainingStep], config: dict) -> list[dict]:
    """One row per step: {step, status, policy_version, episodes, duration_s, error, cells: [{value, fmt, why}]}.

    A cell's value is None while the step has not produced it (pending, training, failed) or
    when it was not computed; `why` then says which ("not computed: kl_coef is 0")."""
    rows = []
    for st in steps:
        m = st.metrics or {}
        cells = []
        for _heading, path, fmt in STEP_COLUMNS:
            why = not_computed(config, path)
            no_update = path in UPDATE_METRICS and metric(m, "optimizer_updates") == 0
            value = None if why or no_update else metric(m, path)
            if why is None and no_update:
                why = "no optimizer update (no trainable token)"
            cells.append({"value": value, "fmt": fmt, "why": f"not computed: {why}" if why else None})
        rows.append({"step": st.step, "status": st.status, "policy_version": st.policy_version,
                     "episodes": len(st.episode_ids or []), "error": st.error, "cells": cells,
                     "duration_s": seconds_between(st.started_at, st.finished_at or (
                         utcnow() if st.status == "training" else None))})
    return rows


def _episodes(s: Session, run_id: int, status: str | None, instance: str | None, outcome: str | None,
              limit: int) -> tuple[list[dict], int]:
    q = (select(Episode, TaskInstance.instance_id).join(TaskInstance, TaskInstance.id == Episode.instance_id)
         .where(Episode.run_id == run_id).order_by(Episode.id))
    if status:
        q = q.where(Episode.status == status)
    if instance:
        q = q.where(TaskInstance.instance_id == instance)
    if outcome == "resolved":
        q = q.where(Episode.resolved.is_(True))
    elif outcome == "unresolved":
        q = q.where(Episode.status == "completed", Episode.resolved.is_not(True))
    matched = s.scalar(select(func.count()).select_from(q.subquery()))
    rows = s.execute(q.limit(limit)).all()
    calls = dict(s.execute(select(Completion.episode_id, func.count()).where(
        Completion.episode_id.in_([e.id for e, _ in rows])).group_by(Completion.episode_id)).all()) if rows else {}
    episodes = []
    states = group_states(s, s.get(Run, run_id)) if rows else {}
    for e, name in rows:
        # why it did not resolve (app.control.failure); its step: its group's (app.api.group_state)
        failure = failure_reason(e.status, e.resolved, e.error, e.timed_out, e.patch, e.grading_report)
        reason = failure["text"] if failure else None
        forfeit = (e.grading_report or {}).get("forfeit") if e.status == "completed" else None
        state = states.get(e.group_index) or {}
        episodes.append({
            "id": e.id, "instance": name, "step": state.get("step"), "step_label": state.get("label"),
            "failure_kind": failure["kind"] if failure else None, "group": e.group_index, "sample": e.sample_index,
            "status": e.status, "reward": e.reward, "resolved": e.resolved, "attempts": e.attempts,
            "duration_s": seconds_between(e.started_at, e.rollout_finished_at or e.finished_at),
            "calls": calls.get(e.id, 0), "exit_status": e.exit_status, "reason": reason,
            "policy_version": e.policy_version, "forfeit": forfeit,
        })
    return episodes, matched


def checkpoint_run(config: dict | None) -> int | None:
    """The run whose weights this run's model starts from (`model.checkpoint` = `run:<id>`), or None."""
    spec = str(((config or {}).get("model") or {}).get("checkpoint") or "")
    tail = spec.removeprefix("run:")
    return int(tail) if spec.startswith("run:") and tail.isdigit() else None


SERIES_ROLES = ("before", "train", "after")


def series_of(config: dict | None) -> tuple[str, str] | None:
    """(series id, role) of a run made with others (`series` of its config, set by `turnstile learn`), or None."""
    series = (config or {}).get("series") or {}
    return (str(series["id"]), str(series.get("role"))) if series.get("id") else None


def related_runs(s: Session, run: Run, window: int = 500) -> dict:
    """The runs made from or with this one: {"parent": run id this run's checkpoint names or None,
    "children": [(id, kind, status)] of the later runs (of the next `window`) that start from this
    run's checkpoint, "series": [{id, kind, status, role, current}] of its `turnstile learn`
    sequence in role order (before, train, after; [] when it has none), "compare": (before id,
    after id) of that sequence or None}."""
    later = s.execute(select(Run.id, Run.kind, Run.status, Run.config).where(Run.id > run.id)
                      .order_by(Run.id).limit(window)).all()
    mine = series_of(run.config)
    members = []
    if mine is not None:
        # a series is made by one command, one run after another: its runs lie within `window` ids
        near = s.execute(select(Run.id, Run.kind, Run.status, Run.config)
                         .where(Run.id >= run.id - window, Run.id <= run.id + window).order_by(Run.id)).all()
        for i, kind, status, cfg in near:
            tag = series_of(cfg)
            if tag is not None and tag[0] == mine[0]:
                members.append({"id": i, "kind": kind, "status": status, "role": tag[1], "current": i == run.id})
        members.sort(key=lambda m: (SERIES_ROLES.index(m["role"]) if m["role"] in SERIES_ROLES else 9, m["id"]))
    roles = {m["role"]: m["id"] for m in members}
    return {"parent": checkpoint_run(run.config),
            "children": [(i, kind, status) for i, kind, status, cfg in later if checkpoint_run(cfg) == run.id],
            "series": members if len(members) > 1 else [],
            "compare": (roles["before"], roles["after"]) if "before" in roles and "after" in roles else None}


def run_detail(s: Session, run_id: int, status: str | None = None, instance: str | None = None,
               outcome: str | None = None, limit: int = 500) -> dict | None:
    """The run page: run, counts, live aggregates, steps, charts, groups and the (filtered) episodes table."""
    run = s.get(Run, run_id)
    if run is None:
        return None
    cfg = run.config or {}
    counts = dict(s.execute(select(Episode.status, func.count()).where(Episode.run_id == run_id)
                            .group_by(Episode.status)).all())
    steps = s.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id).order_by(TrainingStep.step)).all()
    charts, missing = step_charts(steps, cfg)
    heldout = heldout_view(s, run, steps)
    if heldout and heldout["chart"]:
        charts.insert(0, heldout["chart"])  # first, beside the reward chart
    episodes, matched = _episodes(s, run_id, status, instance, outcome, limit)
    instances = s.scalars(select(TaskInstance.instance_id).join(Episode, Episode.instance_id == TaskInstance.id)
                          .where(Episode.run_id == run_id).distinct().order_by(TaskInstance.instance_id)).all()
    graded, reward, resolved = s.execute(
        select(func.count(), func.avg(Episode.reward), func.sum(cast(Episode.resolved, Integer)))
        .where(Episode.run_id == run_id, Episode.status == "completed")).one()
    n_calls, sampled_bytes = s.execute(
        select(func.count(Completion.id), func.coalesce(func.sum(func.length(Completion.sampled_ids)), 0))
        .join(Episode, Episode.id == Completion.episode_id).where(Episode.run_id == run_id)).one()
    return {
        "run": run, "config": cfg, "counts": counts, "total": sum(counts.values()),
        "provenance": chosen_rows(cfg, run.provenance),
        "terminal": run.status in TERMINAL, "age": age(run.created_at), "waiting": waiting_reason(run),
        "duration_s": seconds_between(run.started_at, run.finished_at or (None if run.status in TERMINAL else utcnow())),
        "graded": graded, "reward": float(reward) if reward is not None else None,
        "resolved_rate": int(resolved or 0) / graded if graded else None,
        "completions": n_calls, "sampled_tokens": int(sampled_bytes) // 4,
        "steps": step_rows(steps, cfg), "step_columns": [c[0] for c in STEP_COLUMNS],
        "steps_done": sum(1 for st in steps if st.status == "completed"),
        "charts": charts, "missing_charts": missing, "heldout": heldout,
        "tinker": tinker_progress(s, run_id) if run.kind == "tinker" else None,
        "groups": run_groups(s, run), "related": related_runs(s, run), "eval": eval_results(s, run) if run.kind != "train" else None,
        "episodes": episodes, "episodes_matched": matched, "limit": limit, "instances": instances,
        "states": EPISODE_STATES,
        # what the live refresh compares with `GET /api/runs/<id>` to see that something changed
        "state": {"status": run.status, "episodes_by_status": counts, "policy_version": run.policy_version,
                  "steps": [st.status for st in steps], "completions": n_calls,
                  "waiting": waiting_reason(run) is not None},
    }
