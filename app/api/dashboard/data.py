"""What the runs list, the run page and the compare page show, read from SQL as plain dicts.

Every function takes an open session and returns template-ready values; nothing here renders
HTML.  Aggregates are computed with grouped queries so the runs list costs a fixed number of
queries however many runs it shows.
"""
from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import Integer, cast, func, select
from sqlalchemy.orm import Session

from app.stats import pass_at_k, wilson
from app.tables import (EPISODE_STATES, Completion, Episode, Run, TaskInstance, TrainingStep, aware_utc,
                        utcnow)
from app.transitions import TERMINAL



# --- small helpers ----------------------------------------------------------------------

def seconds_between(a: dt.datetime | None, b: dt.datetime | None) -> float | None:
    a, b = aware_utc(a), aware_utc(b)
    return (b - a).total_seconds() if a is not None and b is not None else None


def age(value: dt.datetime | None, now: dt.datetime | None = None) -> str:
    """`42 s`, `5 min`, `3 h`, `2 d`: how long ago `value` was."""
    s = seconds_between(value, now or utcnow())
    if s is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.0f} {unit}"
    return f"{max(s, 0):.0f} s"


# --- runs list ----------------------------------------------------------------------------

def runs_overview(s: Session, status: str | None = None, kind: str | None = None, limit: int = 100) -> list[dict]:
    """One row per run, newest first: status, kind, harness, model, progress, reward, resolved rate,
    solved instances (`(solved, graded)`: instances with a resolved sample, of those graded), age."""
    q = select(Run).order_by(Run.id.desc()).limit(limit)
    if status:
        q = q.where(Run.status == status)
    if kind:
        q = q.where(Run.kind == kind)
    runs = s.scalars(q).all()
    ids = [r.id for r in runs]
    if not ids:
        return []
    counts: dict[int, dict[str, int]] = {}
    for run_id, st, n in s.execute(select(Episode.run_id, Episode.status, func.count())
                                   .where(Episode.run_id.in_(ids)).group_by(Episode.run_id, Episode.status)):
        counts.setdefault(run_id, {})[st] = n
    graded = {run_id: (n, mean, int(res or 0)) for run_id, n, mean, res in s.execute(
        select(Episode.run_id, func.count(), func.avg(Episode.reward), func.sum(cast(Episode.resolved, Integer)))
        .where(Episode.run_id.in_(ids), Episode.status == "completed").group_by(Episode.run_id))}
    per_instance = s.execute(
        select(Episode.run_id, Episode.instance_id, func.max(cast(Episode.resolved, Integer)))
        .where(Episode.run_id.in_(ids), Episode.status == "completed").group_by(Episode.run_id, Episode.instance_id))
    solved: dict[int, list[int]] = {}
    for run_id, _inst, best in per_instance:
        solved.setdefault(run_id, []).append(int(best or 0))
    steps_done = dict(s.execute(select(TrainingStep.run_id, func.count()).where(
        TrainingStep.run_id.in_(ids), TrainingStep.status == "completed").group_by(TrainingStep.run_id)).all())
    now = utcnow()
    rows = []
    for r in runs:
        cfg = r.config or {}
        by_status = counts.get(r.id, {})
        total = sum(by_status.values())
        done = sum(by_status.get(k, 0) for k in TERMINAL)
        n_graded, reward, resolved = graded.get(r.id, (0, None, 0))
        inst = solved.get(r.id, [])
        rows.append({
            "id": r.id, "kind": r.kind, "status": r.status,
            "harness": cfg.get("harness"), "model": (cfg.get("model") or {}).get("checkpoint") or (cfg.get("model") or {}).get("name"),
            "task_set": cfg.get("task_set"),
            "episodes_done": done, "episodes_total": total,
            "steps_done": steps_done.get(r.id, 0) if r.kind == "train" else None, "steps_total": cfg.get("steps"),
            "reward": float(reward) if reward is not None else None,
            "resolved_rate": resolved / n_graded if n_graded else None,
            "solved_instances": (sum(inst), len(inst)) if inst and r.kind != "train" else None,
            "age": age(r.created_at, now), "created_at": r.created_at, "error": r.error,
        })
    return rows


# --- one run ------------------------------------------------------------------------------

def _get(m: dict | None, path: str) -> float | None:
    node: Any = m or {}
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def _staleness_mean(m: dict | None) -> float | None:
    hist = ((m or {}).get("scheduling") or {}).get("staleness_hist") or {}
    n = sum(hist.values())
    return sum(int(k) * v for k, v in hist.items()) / n if n else None


# (chart title, [(series label, metric path or callable)], band between series 1 and 2)
CHARTS: list[tuple[str, list[tuple[str, Any]], bool]] = [
    ("reward (mean ± std)", [("mean", "reward_mean"), ("mean - std", lambda m: _diff(m, -1)), ("mean + std", lambda m: _diff(m, 1))], True),
    ("resolved rate", [("resolved", "resolved_rate")], False),
    ("loss", [("loss", "loss")], False),
    ("KL", [("kl", "kl")], False),
    ("clip fraction", [("clip fraction", "clip_fraction")], False),
    ("trainer vs rollout logprob gap (nats)", [("max |Δ|", "logprob_gap_max_abs"), ("mean |Δ|", "logprob_gap_mean_abs")], False),
    ("tokens trained", [("trained", "tokens_trained"), ("processed", "tokens_processed")], False),
    ("prefix merging", [("completions", "merge.completions"), ("merged", "merge.completions_merged"),
                        ("chains", "merge.chains"), ("cut", "merge.chains_cut"), ("rejected", "merge.rejected")], False),
    ("trainer busy / rollout slots", [("trainer busy", "scheduling.trainer_busy_fraction"),
                                      ("slot occupancy", "scheduling.rollout_slot_occupancy")], False),
    ("READY wait (s)", [("p50", "scheduling.ready_wait_s.p50"), ("max", "scheduling.ready_wait_s.max")], False),
    ("staleness (policy versions)", [("mean", _staleness_mean)], False),
]


def _diff(m: dict | None, sign: int) -> float | None:
    mean, std = _get(m, "reward_mean"), _get(m, "reward_std")
    return None if mean is None or std is None else mean + sign * std


def step_charts(steps: list[TrainingStep]) -> tuple[list[dict], list[str]]:
    """Per-step curves of the completed steps: ([{id, title, x, series, band}], titles with no data)."""
    done = [st for st in steps if st.status == "completed"]
    x = [st.step for st in done]
    charts, missing = [], []
    for index, (title, spec, band) in enumerate(CHARTS):
        series = []
        for label, how in spec:
            values = [how(st.metrics) if callable(how) else _get(st.metrics, how) for st in done]
            if any(v is not None for v in values):
                series.append({"label": label, "values": values})
        if not series:
            missing.append(title)
            continue
        charts.append({"id": f"chart-{index}", "title": title, "x": x, "series": series,
                       "band": band and len(series) == 3})
    return charts, missing


def run_detail(s: Session, run_id: int, status: str | None = None, instance: str | None = None,
               outcome: str | None = None, limit: int = 500) -> dict | None:
    """The run page: run, counts, live aggregates, steps, charts and the (filtered) episodes table."""
    run = s.get(Run, run_id)
    if run is None:
        return None
    counts = dict(s.execute(select(Episode.status, func.count()).where(Episode.run_id == run_id)
                            .group_by(Episode.status)).all())
    steps = s.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id).order_by(TrainingStep.step)).all()
    charts, missing = step_charts(steps)
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
    for e, name in rows:
        reason = e.error
        if reason is None and e.timed_out:
            reason = "harness timed out"
        if reason is None and e.grading_report and (e.grading_report.get("apply") or {}).get("reason"):
            reason = e.grading_report["apply"]["reason"]
        episodes.append({
            "id": e.id, "instance": name, "step": e.step, "group": e.group_index, "sample": e.sample_index,
            "status": e.status, "reward": e.reward, "resolved": e.resolved, "attempts": e.attempts,
            "duration_s": seconds_between(e.started_at, e.rollout_finished_at or e.finished_at),
            "calls": calls.get(e.id, 0), "exit_status": e.exit_status, "reason": reason,
            "policy_version": e.policy_version,
        })
    instances = s.scalars(select(TaskInstance.instance_id).join(Episode, Episode.instance_id == TaskInstance.id)
                          .where(Episode.run_id == run_id).distinct().order_by(TaskInstance.instance_id)).all()
    graded, reward, resolved = s.execute(
        select(func.count(), func.avg(Episode.reward), func.sum(cast(Episode.resolved, Integer)))
        .where(Episode.run_id == run_id, Episode.status == "completed")).one()
    n_calls, sampled_bytes = s.execute(
        select(func.count(Completion.id), func.coalesce(func.sum(func.length(Completion.sampled_ids)), 0))
        .join(Episode, Episode.id == Completion.episode_id).where(Episode.run_id == run_id)).one()
    cfg = run.config or {}
    return {
        "run": run, "config": cfg, "counts": counts, "total": sum(counts.values()),
        "terminal": run.status in TERMINAL, "age": age(run.created_at),
        "duration_s": seconds_between(run.started_at, run.finished_at or (None if run.status in TERMINAL else utcnow())),
        "graded": graded, "reward": float(reward) if reward is not None else None,
        "resolved_rate": int(resolved or 0) / graded if graded else None,
        "completions": n_calls, "sampled_tokens": int(sampled_bytes) // 4,
        "steps": steps, "steps_done": sum(1 for st in steps if st.status == "completed"),
        "charts": charts, "missing_charts": missing,
        "episodes": episodes, "episodes_matched": matched, "limit": limit, "instances": instances,
        "states": EPISODE_STATES,
        # what the live refresh compares with `GET /api/runs/<id>` to see that something changed
        "state": {"status": run.status, "episodes_by_status": counts, "policy_version": run.policy_version,
                  "steps": [st.status for st in steps], "completions": n_calls},
    }


# --- compare two eval runs ----------------------------------------------------------------

def _instance_results(s: Session, run_id: int) -> dict[str, tuple[int, int]]:
    rows = s.execute(select(TaskInstance.instance_id, func.count(), func.sum(cast(Episode.resolved, Integer)))
                     .join(TaskInstance, TaskInstance.id == Episode.instance_id)
                     .where(Episode.run_id == run_id, Episode.status == "completed")
                     .group_by(TaskInstance.instance_id)).all()
    return {name: (n, int(c or 0)) for name, n, c in rows}


def compare_runs(s: Session, a_id: int, b_id: int) -> dict | None:
    """pass@1 and pass@k per instance and overall for two runs, with 95% Wilson intervals.

    k is the smaller run's group size, so both columns estimate the same quantity.  Overall
    pass@k is the mean of the per-instance unbiased estimates; its interval treats instances
    as the unit (a resolved-instance count out of the instances graded).
    """
    a, b = s.get(Run, a_id), s.get(Run, b_id)
    if a is None or b is None:
        return None
    k = max(1, min(int((a.config or {}).get("group_size") or 1), int((b.config or {}).get("group_size") or 1)))
    results = [_instance_results(s, a.id), _instance_results(s, b.id)]
    names = sorted(set(results[0]) | set(results[1]))
    rows = []
    for name in names:
        cells = []
        for res in results:
            if name not in res:
                cells.append(None)
                continue
            n, c = res[name]
            cells.append({"n": n, "c": c, "pass1": c / n if n else None, "pass1_ci": wilson(c, n),
                          "passk": pass_at_k(n, c, k)})
        rows.append({"instance": name, "cells": cells})
    overall = []
    for res in results:
        n = sum(v[0] for v in res.values())
        c = sum(v[1] for v in res.values())
        estimates = [p for v in res.values() if (p := pass_at_k(v[0], v[1], k)) is not None]
        solved = sum(1 for v in res.values() if v[1] > 0)
        overall.append({"n": n, "c": c, "instances": len(res), "pass1": c / n if n else None,
                        "pass1_ci": wilson(c, n) if n else None,
                        "passk": sum(estimates) / len(estimates) if estimates else None,
                        "passk_ci": wilson(solved, len(res)) if len(res) else None})
    return {"runs": [a, b], "k": k, "rows": rows, "overall": overall}
