"""Runs for the comparison tests, written into the dashboard site's database: a train run, two evals
that compare (before and after it, on instances it never trained on), and one pair per reason a
comparison is refused.  Instance names are this module's own, so the site's other rows are untouched."""
from __future__ import annotations

import datetime as dt

from app.db import session_scope
from app.runconfig import RunConfig
from app.tables import Episode, Run, TaskInstance

TRAIN = ["cmp__train-1", "cmp__train-2"]
HELD = ["cmp__held-1", "cmp__held-2", "cmp__held-3"]
OTHER = ["cmp__held-1", "cmp__held-2", "cmp__other-1"]  # neither contains HELD nor is contained in it
T0 = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.timezone.utc)

# (before, after) of each case, by the labels `seed_pairs` returns
CASES = {"running": ("running_eval", "after"), "queued": ("queued_eval", "after"), "train": ("train", "after"),
         "instances": ("other_eval", "after"), "overlap": ("train_set_before", "train_set_after")}
# what the refusal (and, forced, the warning) says in each case
REFUSALS = [("running", "is running: its results are partial"),
            ("queued", "is queued: it never started, it has no results"),
            ("train", "is a train run, not an eval"),
            ("instances", "the runs sample different instances (1 only in"),
            ("overlap", "instance(s) it trained on (cmp__train-1, cmp__train-2): not held-out")]


def _config(kind: str, instances: list[str], checkpoint: str | None = None) -> dict:
    return RunConfig.model_validate({
        "kind": kind, "harness": "mini-swe-agent", "task_set": "synthetic", "instances": instances,
        "group_size": 2, "tasks_per_step": len(instances), "steps": 1,
        "model": {"name": "smollm2", "checkpoint": checkpoint}}).model_dump(mode="json")


def _run(s, kind: str, status: str, instances: list[str], rows: dict, pattern: str = "",
         checkpoint: str | None = None) -> int:
    """A run over `instances`; `pattern` holds two marks per instance (1/0 a completed sample,
    resolved or not; R a running one); a queued run gets no episodes."""
    run = Run(kind=kind, status=status, config=_config(kind, instances, checkpoint), created_at=T0,
              started_at=None if status == "queued" else T0)
    s.add(run)
    s.flush()
    for g, name in enumerate(instances):
        for k, mark in enumerate(pattern[2 * g:2 * g + 2]):
            done = mark in "01"
            s.add(Episode(run_id=run.id, instance_id=rows[name].id, step=0, group_index=g, sample_index=k,
                          status="completed" if done else "running", attempts=1, policy_version=0,
                          reward=float(mark == "1") if done else None, resolved=(mark == "1") if done else None,
                          started_at=T0))
    s.flush()
    return run.id


def seed_pairs() -> dict[str, int]:
    """Write the runs; their ids by label."""
    with session_scope() as s:
        rows = {}
        for name in dict.fromkeys(TRAIN + HELD + OTHER):
            rows[name] = TaskInstance(task_set="synthetic", instance_id=name, repo="synthetic/cmp",
                                      base_commit="0" * 40, record={"instance_id": name})
            s.add(rows[name])
        s.flush()
        ids = {"train": _run(s, "train", "completed", TRAIN, rows, "1001")}
        ckpt = f"run:{ids['train']}"
        ids["before"] = _run(s, "eval", "completed", HELD, rows, "000110")
        ids["after"] = _run(s, "eval", "completed", HELD, rows, "101111", ckpt)
        # as `turnstile learn` makes them: the before run also sampled instances the after run did not
        ids["wider_before"] = _run(s, "eval", "completed", HELD + ["cmp__other-1"], rows, "00011010")
        ids["running_eval"] = _run(s, "eval", "running", HELD, rows, "1RRR0R")
        ids["queued_eval"] = _run(s, "eval", "queued", HELD, rows)
        ids["other_eval"] = _run(s, "eval", "completed", OTHER, rows, "010011")
        ids["train_set_before"] = _run(s, "eval", "completed", TRAIN, rows, "0001")
        ids["train_set_after"] = _run(s, "eval", "completed", TRAIN, rows, "1111", ckpt)
    return ids
