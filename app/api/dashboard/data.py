"""What the runs list shows, read from SQL as plain dicts, and the time helpers every page uses.

Every function takes an open session and returns template-ready values; nothing here renders
HTML.  Aggregates are computed with grouped queries so the runs list costs a fixed number of
queries however many runs it shows.
"""
from __future__ import annotations

import datetime as dt

from sqlalchemy import Integer, cast, func, select
from sqlalchemy.orm import Session

from app.api.labels import RunFilter
from app.config import get_settings
from app.tables import Episode, Run, TrainingStep, aware_utc, utcnow
from app.tensorboard_runs import tensorboard_url
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

RUNS_SHOWN = 100  # the runs list's length; its live refresh asks the API for as many (static/runs.js)


def runs_overview(s: Session, where: RunFilter | None = None, limit: int = RUNS_SHOWN) -> list[dict]:
    """One row per run that `where` shows (every run when None), newest first: name, tags, status, kind,
    harness, model, progress, reward, resolved rate, solved instances (`(solved, graded)`: instances
    with a resolved sample, of those graded), age, and its TensorBoard link (None: no address set)."""
    q = (where or RunFilter()).apply(select(Run)).order_by(Run.id.desc()).limit(limit)
    runs = s.scalars(q).all()
    tensorboard = get_settings().tensorboard_url
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
            "id": r.id, "kind": r.kind, "status": r.status, "name": r.name, "tags": r.tags or [], "notes": r.notes,
            "policy_version": r.policy_version, "by_status": by_status,
            "tensorboard_url": tensorboard_url(tensorboard, r.id, r.kind, cfg.get("harness"), r.name),
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
