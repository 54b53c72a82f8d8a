"""The end-of-run summary: per-step reward and resolved rate, captures, merges, timing.

Computed from SQL only, so it can be recomputed for any finished run.
"""
from __future__ import annotations

import statistics

from sqlalchemy import Integer, cast, func, select
from sqlalchemy.orm import Session

from app.control.stages import HARNESS_FAILED, harness_failure_cause
from app.stats import percentile
from app.tables import Completion, Episode, Group, TrainingStep, aware_utc


def _duration(a, b) -> float | None:
    return (b - a).total_seconds() if a is not None and b is not None else None


def _harness_failed(run_id: int):
    """SQL condition: the run's episodes failed because their harness made no usable model call."""
    return (Episode.run_id == run_id) & (Episode.status == "failed") & Episode.error.startswith(HARNESS_FAILED)


def harness_failed_count(s: Session, run_id: int) -> int:
    """Episodes of the run failed as harness failures (no usable model call; see `app.control.stages`)."""
    return int(s.scalar(select(func.count()).select_from(Episode).where(_harness_failed(run_id))) or 0)


def harness_never_worked(s: Session, run_id: int, harness: str, group_size: int) -> str | None:
    """The run's stop message when its harness has not made one usable model call, else None.

    Rule: no episode completed and at least `group_size` episodes (one group's worth) failed
    as harness failures.  The message names the harness, the count of such failures among
    the finished (completed or failed) episodes, and the latest failure's cause, e.g.
    "harness codex failed before any usable model call in 2 of 2 finished episodes: codex
    exited 1: its first prompt did not fit the model's context window (…)".
    """
    completed = s.scalar(select(func.count()).select_from(Episode).where(
        Episode.run_id == run_id, Episode.status == "completed"))
    if completed:
        return None
    count = harness_failed_count(s, run_id)
    if count < max(1, group_size):
        return None
    finished = s.scalar(select(func.count()).select_from(Episode).where(
        Episode.run_id == run_id, Episode.status.in_(("completed", "failed"))))
    last = s.scalar(select(Episode.error).where(_harness_failed(run_id))
                    .order_by(Episode.finished_at.desc(), Episode.id.desc()).limit(1))
    return (f"harness {harness} failed before any usable model call in {count} of {finished} finished episodes: "
            f"{harness_failure_cause(last)}")


def summarize_run(s: Session, run_id: int) -> dict:
    """Aggregate a run: steps, rewards, instances solved, captures, stage times, trainer busy fraction.

    `solved` maps each graded instance to whether any of its samples resolved it (summaries
    stored before this name call it `pass_at_k`; readers accept both).  pass@k proper, Chen's
    estimator, is `app.stats.pass_at_k`.
    """
    eps = s.scalars(select(Episode).where(Episode.run_id == run_id)).all()
    steps = s.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id).order_by(TrainingStep.step)).all()
    groups = s.scalars(select(Group).where(Group.run_id == run_id)).all()
    graded = [e for e in eps if e.status == "completed"]
    by_status: dict[str, int] = {}
    for e in eps:
        by_status[e.status] = by_status.get(e.status, 0) + 1

    per_step = []
    for st in steps:
        ids = set(st.episode_ids or [])
        rewards = [e.reward for e in graded if e.id in ids and e.reward is not None]
        # Every group drawn for the step: the trained ones and those dynamic sampling set aside.
        drawn = {g.group_index for g in groups if g.step == st.step and g.status in ("trained", "filtered")}
        sampled = [e.reward for e in graded if e.group_index in drawn and e.reward is not None]
        per_step.append({
            "step": st.step,
            "status": st.status,
            "policy_version": st.policy_version,
            "episodes": len(ids),
            "reward_mean": statistics.fmean(rewards) if rewards else None,
            "sampled_reward_mean": statistics.fmean(sampled) if sampled else None,
            "groups_filtered": sum(1 for g in groups if g.step == st.step and g.status == "filtered"),
            "resolved_rate": (sum(1 for e in graded if e.id in ids and e.resolved) / len(ids)) if ids else None,
            "train_s": _duration(st.started_at, st.finished_at),
            "metrics": st.metrics,
        })

    # Instances solved (eval): an instance is solved when any of its samples resolved it.
    per_instance: dict[str, list[bool]] = {}
    for e in graded:
        per_instance.setdefault(e.instance.instance_id, []).append(bool(e.resolved))
    rollout_s = [d for e in eps if (d := _duration(e.started_at, e.rollout_finished_at)) is not None]
    prepare_s = [d for e in eps if (d := _duration(e.created_at, e.prepared_at)) is not None]
    grade_s = [d for e in eps if (d := _duration(e.rollout_finished_at, e.finished_at)) is not None and e.status == "completed"]

    n_completions, n_partial, n_rejected, sampled = s.execute(
        select(func.count(Completion.id), func.sum(cast(Completion.partial, Integer)),
               func.count(Completion.rejected_reason), func.count(Completion.sampled_ids))
        .join(Episode, Episode.id == Completion.episode_id).where(Episode.run_id == run_id)
    ).one()

    train_spans = [(st.started_at, st.finished_at) for st in steps if st.started_at and st.finished_at]
    busy = None
    if train_spans:
        first = min(a for a, _ in train_spans)
        last = max(b for _, b in train_spans)
        total = (last - first).total_seconds()
        busy = sum((b - a).total_seconds() for a, b in train_spans) / total if total > 0 else 1.0

    merge = {"completions": 0, "chains": 0, "merged": 0, "cut": 0, "rejected": 0}
    for e in eps:
        for stats in (e.merge_stats or {}).values():
            merge["completions"] += stats.get("completions", 0)
            merge["chains"] += stats.get("chains", 0)
            merge["merged"] += stats.get("completions_merged", 0)
            merge["cut"] += stats.get("chains_cut", 0)
            merge["rejected"] += stats.get("rejected", 0)
    gaps = [st.metrics.get("logprob_gap_max_abs") for st in steps if st.metrics and st.metrics.get("logprob_gap_max_abs") is not None]

    return {
        "episodes_by_status": by_status,
        "merge": merge,
        "logprob_gap_max_abs": max(gaps) if gaps else None,
        "reward_mean": statistics.fmean([e.reward for e in graded]) if graded else None,
        "resolved_rate": (sum(1 for e in graded if e.resolved) / len(graded)) if graded else None,
        "solved": {k: any(v) for k, v in sorted(per_instance.items())},
        "steps": per_step,
        "groups_by_status": {st: sum(1 for g in groups if g.status == st) for st in {g.status for g in groups}},
        "completions": int(n_completions or 0),
        "partial_completions": int(n_partial or 0),
        "rejected_completions": int(n_rejected or 0),
        "timed_out_episodes": sum(1 for e in eps if e.timed_out),
        "episodes_harness_failed": sum(1 for e in eps if e.status == "failed" and harness_failure_cause(e.error)),
        "stage_seconds": {
            "prepare_p50": percentile(prepare_s, 0.5), "rollout_p50": percentile(rollout_s, 0.5),
            "rollout_p99": percentile(rollout_s, 0.99), "grade_p50": percentile(grade_s, 0.5),
        },
        "trainer_busy_fraction": busy,
    }



def scheduling_metrics(s: Session, run_id: int, slots: int, lags: list[int], ready_waits: list[float]) -> dict:
    """Scheduling health when a step is created (issue 8): trainer busy fraction so far, rollout
    slot occupancy and episode durations since the previous step, READY waits, staleness of the
    step's groups, and cumulative dropped/rejected/cancelled counts, and the cumulative count
    of episodes failed as harness failures (`episodes_harness_failed`: no usable model call,
    so never graded nor trained on)."""
    from app.tables import utcnow

    now = utcnow()
    steps = s.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id).order_by(TrainingStep.step)).all()
    window_start = aware_utc(steps[-1].created_at) if steps else None
    eps = s.scalars(select(Episode).where(Episode.run_id == run_id, Episode.started_at.is_not(None))).all()
    if window_start is None:
        window_start = min((aware_utc(e.started_at) for e in eps), default=now)
    window = max(1e-9, (now - window_start).total_seconds())
    busy_s = 0.0
    durations = []
    for e in eps:
        start, end = aware_utc(e.started_at), aware_utc(e.rollout_finished_at or e.finished_at) or now
        overlap = (min(end, now) - max(start, window_start)).total_seconds()
        busy_s += max(0.0, overlap)
        if e.rollout_finished_at is not None and aware_utc(e.rollout_finished_at) >= window_start:
            durations.append((end - start).total_seconds())
    spans = [(aware_utc(st.started_at), aware_utc(st.finished_at)) for st in steps if st.started_at and st.finished_at]
    trainer_busy = None
    if spans:
        total = (now - spans[0][0]).total_seconds()
        trainer_busy = sum((b - a).total_seconds() for a, b in spans) / total if total > 0 else 1.0
    groups = s.scalars(select(Group.status).where(Group.run_id == run_id)).all()
    return {
        "trainer_busy_fraction": trainer_busy,
        "rollout_slot_occupancy": min(1.0, busy_s / (slots * window)),
        "ready_wait_s": {"n": len(ready_waits), "p50": percentile(ready_waits, 0.5), "max": max(ready_waits, default=None)},
        "episode_duration_s": {"n": len(durations), "p50": percentile(durations, 0.5), "p90": percentile(durations, 0.9),
                               "p99": percentile(durations, 0.99), "max": max(durations, default=None)},
        "staleness_hist": {str(k): lags.count(k) for k in sorted(set(lags))},
        "groups_dropped": groups.count("dropped"),
        "groups_rejected": groups.count("rejected"),
        "groups_filtered": groups.count("filtered"),
        "episodes_cancelled": s.scalar(select(func.count()).where(Episode.run_id == run_id, Episode.status == "cancelled")),
        "episodes_harness_failed": harness_failed_count(s, run_id),
    }
