"""Several LoRA train runs on one deployment, against the same runs one after another: wall time,
trainer busy fraction and rollout tokens/s, side by side in one invocation.

    scripts/with_stack.sh tenants .venv/bin/python bench/tenants_wall.py [--runs 1,2,4] [--steps 2]

Needs the running stack (API, gateway, embedded engine with SmolLM2, rollout and gpu workers), as
`scripts/with_stack.sh` starts it; reads the results from the same SQL database.  For each k in
`--runs`: k LoRA train runs (one config, seeds 0..k-1) created at once and waited for
("concurrent"), then the same k runs created one after another, each waited for ("sequential";
for k = 1 the two are one measurement).  Per setting:

* wall time: first creation to last run finished (s), and concurrent / sequential;
* trainer busy fraction: the steps' `step_time_s` summed, over the wall time;
* rollout tokens/s: tokens sampled by the runs' completions, over the wall time;
* the machine's CPU busy fraction over the wall time (`/proc/stat`: 1 - idle and iowait share),
  which says whether anything was left idle for concurrent runs to use.

Goal (issue: many runs on one deployment): 4 concurrent runs in <= 0.5 x the sequential wall time.
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
from sqlalchemy import func, select  # noqa: E402

from app.auth import auth_header  # noqa: E402
from app.config import get_settings  # noqa: E402
from app.db import session_scope  # noqa: E402
from app.tables import Completion, Episode, Run, TrainingStep  # noqa: E402

DONE = ("completed", "failed", "cancelled")


def run_config(args, seed: int) -> dict:
    """A small LoRA train run on the bundled starter tasks (mini-swe-agent, SmolLM2)."""
    return {"kind": "train", "task_set": "starter", "instances": args.instances.split(","),
            "harness": "mini-swe-agent", "model": {"name": "smollm2", "engine": "embedded"},
            "group_size": args.group_size, "tasks_per_step": 1, "steps": args.steps, "mode": "async",
            "budget": {"max_turns": args.max_turns, "max_tokens": args.max_tokens},
            "scheduling": {"max_async_level": 1, "rollout_slots": args.slots, "dynamic_sampling": False},
            "training": {"lora": True, "lora_r": 16, "lora_alpha": 32, "learning_rate": 2e-4, "seed": seed}}


def create(api: httpx.Client, config: dict) -> int:
    answer = api.post("/api/runs", json=config)
    if answer.status_code != 202:
        raise SystemExit(f"POST /api/runs answered {answer.status_code}: {answer.text[:500]}")
    return int(answer.json()["id"])


def wait(run_ids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with session_scope() as s:
            states = s.scalars(select(Run.status).where(Run.id.in_(run_ids))).all()
        if len(states) == len(run_ids) and all(state in DONE for state in states):
            return
        time.sleep(2)
    raise SystemExit(f"runs {run_ids} not finished after {timeout_s:.0f} s")


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (`/proc/stat` "cpu" line; idle + iowait are idle)."""
    with open("/proc/stat") as handle:
        fields = [int(x) for x in handle.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def figures(run_ids: list[int], wall_s: float, cpu_start: tuple[int, int]) -> dict:
    with session_scope() as s:
        states = dict(s.execute(select(Run.id, Run.status).where(Run.id.in_(run_ids))).all())
        step_s = sum(float((m or {}).get("step_time_s") or 0.0) for m in s.scalars(
            select(TrainingStep.metrics).where(TrainingStep.run_id.in_(run_ids), TrainingStep.status == "completed")))
        steps = s.scalar(select(func.count()).select_from(TrainingStep).where(
            TrainingStep.run_id.in_(run_ids), TrainingStep.status == "completed"))
        tokens = sum(len(ids or []) for ids in s.scalars(
            select(Completion.sampled_ids).join(Episode, Episode.id == Completion.episode_id)
            .where(Episode.run_id.in_(run_ids))))
    busy, total = (now - then for now, then in zip(cpu_times(), cpu_start))
    return {"runs": run_ids, "states": sorted(set(states.values())), "steps_completed": steps,
            "cpu_busy_fraction": round(busy / max(total, 1), 3),
            "wall_s": round(wall_s, 1), "trainer_busy_fraction": round(step_s / wall_s, 3),
            "rollout_tokens_per_s": round(tokens / wall_s, 1), "tokens_sampled": tokens}


def concurrent(api, args, k: int) -> dict:
    started, cpu = time.monotonic(), cpu_times()
    ids = [create(api, run_config(args, seed)) for seed in range(k)]
    wait(ids, args.timeout_s)
    return figures(ids, time.monotonic() - started, cpu)


def sequential(api, args, k: int) -> dict:
    started, cpu, ids = time.monotonic(), cpu_times(), []
    for seed in range(k):
        ids.append(create(api, run_config(args, seed)))
        wait(ids[-1:], args.timeout_s)
    return figures(ids, time.monotonic() - started, cpu)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="1,2,4", help="concurrent run counts to measure")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--slots", type=int, default=4, help="rollout_slots of each run")
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--instances", default="starter__listkit-1,starter__tempkit-1")
    parser.add_argument("--timeout-s", type=float, default=3600)
    args = parser.parse_args()
    api = httpx.Client(base_url=get_settings().api_url, headers=auth_header(), timeout=60)
    out = {"config": run_config(args, 0), "settings": []}
    for k in (int(x) for x in args.runs.split(",")):
        row = {"runs": k, "concurrent": concurrent(api, args, k)}
        row["sequential"] = row["concurrent"] if k == 1 else sequential(api, args, k)
        row["ratio_concurrent_to_sequential"] = round(row["concurrent"]["wall_s"] / row["sequential"]["wall_s"], 3)
        out["settings"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)  # progress: one setting at a time
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
