"""What a train run's trainer is doing now, in words, from SQL: the `trainer` of `GET /api/runs/<id>`.

The step the trainer works on next and where it is:

    waiting_for_groups   no step row yet: the scheduler creates step N once `tasks_per_step`
                         groups are accepted (`app.control.scheduler._maybe_create_step`)
    gpu_queue            the row is `pending`: sent to the gpu queue, no trainer has taken it
    training             the row is `training` and has no checkpoint yet (`started_at` on)
    pushing_weights      the row is `training` and its checkpoint is written
                         (`app.training.steps` records it before the engines load the weights)
    failed               a step failed (its error)
    done / stopped       every step trained / the run ended first
    not_started          the run has not started
"""
from __future__ import annotations

import datetime as dt

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.tables import Group, Run, TrainingStep, aware_utc, utcnow
from app.transitions import TERMINAL

TRAINER_STATES = ("not_started", "waiting_for_groups", "gpu_queue", "training", "pushing_weights", "failed", "done",
                  "stopped")


def _since(value: dt.datetime | None, now: dt.datetime) -> float | None:
    value = aware_utc(value)
    return max(0.0, (now - value).total_seconds()) if value is not None else None


def trainer_state(s: Session, run: Run, steps: list[TrainingStep], now: dt.datetime | None = None) -> dict | None:
    """{"state" (one of `TRAINER_STATES`), "step" (the step it is about, or None), "text" (one
    line), "seconds" (in this state so far: on the gpu queue since the row was created, training
    since it started; else None), "groups_ready", "groups_needed" (waiting_for_groups only)} of
    train run `run` with its `steps` (in step order); None for eval and collect runs."""
    if run.kind != "train":
        return None
    now = now or utcnow()
    total = int((run.config or {}).get("steps") or 0)
    out = {"state": "", "step": None, "text": "", "seconds": None, "groups_ready": None, "groups_needed": None}
    failed = next((st for st in steps if st.status == "failed"), None)
    live = next((st for st in steps if st.status in ("pending", "training")), None)
    done = sum(1 for st in steps if st.status == "completed")
    if run.status == "queued":
        return {**out, "state": "not_started", "text": "the run has not started"}
    if failed is not None:
        return {**out, "state": "failed", "step": failed.step,
                "text": f"step {failed.step} failed" + (f": {failed.error}" if failed.error else "")}
    if live is not None and live.status == "training":
        if live.checkpoint_path:
            return {**out, "state": "pushing_weights", "step": live.step, "text": f"step {live.step} pushing weights"}
        seconds = _since(live.started_at, now)
        return {**out, "state": "training", "step": live.step, "seconds": seconds,
                "text": f"step {live.step} training" + (f" ({seconds:.0f} s)" if seconds is not None else "")}
    if live is not None:
        seconds = _since(live.created_at, now)
        return {**out, "state": "gpu_queue", "step": live.step, "seconds": seconds,
                "text": f"step {live.step} on the gpu queue" + (f" ({seconds:.0f} s)" if seconds is not None else "")}
    if total and done >= total:
        return {**out, "state": "done", "text": f"all {total} steps trained"}
    if run.status in TERMINAL or run.status == "cancelling":
        return {**out, "state": "stopped", "text": f"stopped after {done} of {total} steps: the run is {run.status}"}
    step = len(steps)
    ready = s.scalar(select(func.count()).select_from(Group).where(Group.run_id == run.id, Group.status == "accepted"))
    needed = int((run.config or {}).get("tasks_per_step") or 1)
    return {**out, "state": "waiting_for_groups", "step": step, "groups_ready": ready, "groups_needed": needed,
            "text": f"step {step} waiting for its groups ({min(ready, needed)}/{needed} ready)"}
