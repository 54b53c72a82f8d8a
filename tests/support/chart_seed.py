"""Train runs in every state a run page's charts can be in, written to SQL as the trainer writes steps.

Each run holds only `TrainingStep` rows (the charts read nothing else):
  zero       no completed step (step 0 training)
  one        exactly one completed step: loss -0.0077, grad norm 0.04, TIS weight 1.0 and a ratio 3e-8 above it
  two        two steps
  fifty      50 steps: an all-negative loss (-0.0077 .. -0.0079), a mixed-sign advantage mean, a constant clip fraction
  twelve     12 steps of a run that learns (the screenshots' run)
  nan_none   a NaN loss, a grad norm recorded as None (null), a metric absent on one step
kl is never computed (`kl_coef` 0) and entropy never recorded in any of them.
"""
from __future__ import annotations

import datetime as dt
import math

from app.db import session_scope
from app.runconfig import RunConfig
from app.tables import Run, TrainingStep

T0 = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.timezone.utc)


def step_metrics(step: int, n: int) -> dict:
    """Metrics of step `step` of an `n`-step run, with the keys `Trainer.update` and the scheduler record."""
    t = step / max(1, n - 1)
    return {"episodes": 4, "reward_mean": 0.25 + 0.5 * t, "reward_std": 0.4, "resolved_rate": 0.25 + 0.5 * t,
            "loss": -0.0077 - 0.0002 * t, "grad_norm": 0.04 + 0.3 * t,
            "advantage_mean": 0.05 * math.sin(step + 0.5), "advantage_std": 0.03, "clip_fraction": 0.125,
            "tis_weight_mean": 1.0, "ratio_mean": 1.0 + 3e-8 * (1 + step), "tis_truncated_fraction": 0.0, "optimizer_updates": 1,
            "tokens_trained": 400 + 10 * step, "step_time_s": 11.5 + step % 3}


STATES = {"zero": 0, "one": 1, "two": 2, "fifty": 50, "twelve": 12, "nan_none": 3}


def seed_chart_states() -> dict[str, int]:
    """Write one train run per state; returns {state: run id}."""
    cfg = RunConfig.model_validate({"kind": "train", "harness": "mini-swe-agent", "task_set": "synthetic",
                                    "group_size": 2, "tasks_per_step": 2, "steps": 50}).model_dump(mode="json")
    ids = {}
    with session_scope() as s:
        for state, n in STATES.items():
            run = Run(kind="train", status="completed" if n else "running", config=cfg, policy_version=n,
                      created_at=T0, started_at=T0, name=f"charts-{state}")
            s.add(run)
            s.flush()
            ids[state] = run.id
            for step in range(n):
                m = step_metrics(step, n)
                if state == "nan_none":
                    m["loss"] = math.nan if step == 1 else m["loss"]
                    m["grad_norm"] = None if step == 1 else m["grad_norm"]
                    if step == 2:
                        del m["tokens_trained"]
                s.add(TrainingStep(run_id=run.id, step=step, status="completed", policy_version=step + 1, metrics=m,
                                   started_at=T0 + dt.timedelta(minutes=step),
                                   finished_at=T0 + dt.timedelta(minutes=step, seconds=12)))
            if n == 0:
                s.add(TrainingStep(run_id=run.id, step=0, status="training", started_at=T0))
    return ids
