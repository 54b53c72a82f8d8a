"""Synchronous vs asynchronous rollouts through the real Celery queues on Redis.

Episodes are simulated (lognormal durations, p99 ≈ 10x the median) and a
training step is a fixed-length sleep on the `gpu` queue; everything else is the
production path: the REST-created run, the control loop's ticks, the READY buffer,
prepare/rollout/grade/gpu tasks on real worker processes, SQL state.

Prints, for both modes: wall time to N steps, trainer busy fraction (time in
train steps / time from the first step's start to the last step's end), the
staleness of trained groups, and the lower bound (N steps back to back plus the
first step's rollout, measured in the async run).  Goal (issue 8): async busy
fraction >= 0.95 with staleness <= 2 and wall time within 10% of the lower bound;
sync/async wall-time ratio >= 2.77 (AReaL's reported speedup).

    .venv/bin/python bench/scheduler.py [--steps 8] [--train-s 2.0] [--median-s 1.0]
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _workers(env: dict, slots: int) -> list[subprocess.Popen]:
    base = [sys.executable, "-m", "celery", "-A", "app", "worker", "--without-heartbeat", "--without-mingle",
            "--without-gossip", "-O", "fair", "--loglevel", "WARNING"]
    specs = [("control,prepare,grade", 4, "cpu"), ("rollout", slots, "rollout"), ("gpu", 1, "gpu")]
    return [subprocess.Popen([*base, "-Q", q, "-c", str(c), "-n", f"bench-{n}@%h"], cwd=ROOT, env=env,
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for q, c, n in specs]


def _run(config: dict) -> dict:
    from sqlalchemy import select

    from app import create_app
    from app.db import session_scope
    from app.tables import Episode, Group, Run, TrainingStep

    from app.auth import auth_header

    client = create_app().test_client()
    resp = client.post("/api/runs", json=config, headers=auth_header())
    assert resp.status_code == 202, resp.get_json()
    run_id = resp.get_json()["id"]
    t0 = time.monotonic()
    while True:
        with session_scope() as s:
            status = s.get(Run, run_id).status
        if status in ("completed", "failed", "cancelled"):
            break
        if time.monotonic() - t0 > 1800:
            raise SystemExit(f"run {run_id} did not finish in 30 min")
        time.sleep(0.2)
    with session_scope() as s:
        run = s.get(Run, run_id)
        steps = s.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id).order_by(TrainingStep.step)).all()
        groups = s.scalars(select(Group).where(Group.run_id == run_id)).all()
        eps = s.scalars(select(Episode).where(Episode.run_id == run_id)).all()
        staleness = []  # per trained group: version it was trained from - oldest start version of its episodes
        for g in groups:
            if g.status == "trained":
                step = next(st for st in steps if st.step == g.step)
                started = min(e.policy_version for e in eps if e.group_index == g.group_index and e.status == "completed")
                staleness.append((step.policy_version - 1) - started)
        first_rollout = (steps[0].started_at - run.started_at).total_seconds() if steps else None
        wall = (steps[-1].finished_at - run.started_at).total_seconds() if steps else None
        return {
            "status": status,
            "wall_s": wall,
            "busy": run.summary.get("trainer_busy_fraction"),
            "first_rollout_s": first_rollout,
            "staleness_max": max(staleness) if staleness else None,
            "staleness_hist": {k: staleness.count(k) for k in sorted(set(staleness))},
            "groups": run.summary.get("groups_by_status"),
            "episodes": len(eps),
            "cancelled": sum(1 for e in eps if e.status == "cancelled"),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tasks-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--median-s", type=float, default=1.0)
    parser.add_argument("--sigma", type=float, default=1.0, help="log-sigma; 1.0 gives p99 ≈ 10x median")
    parser.add_argument("--train-s", type=float, default=2.0)
    parser.add_argument("--slots", type=int, default=24)
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="turnstile-bench-")
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp}/bench.db", "REDIS_URL": "redis://127.0.0.1:6379/8",
           "PYTHONPATH": str(ROOT)}
    os.environ.update({k: env[k] for k in ("DATABASE_URL", "REDIS_URL")})
    import redis

    redis.Redis.from_url(env["REDIS_URL"]).flushdb()
    from app.db import get_engine
    from app.tables import Base

    Base.metadata.create_all(get_engine())
    procs = _workers(env, args.slots)
    try:
        time.sleep(4)
        common = {"kind": "train", "group_size": args.group_size, "tasks_per_step": args.tasks_per_step,
                  "steps": args.steps, "instances": [f"sim-{i}" for i in range(args.tasks_per_step * 2)],
                  "simulate": {"episode_median_s": args.median_s, "episode_sigma": args.sigma,
                               "train_s": args.train_s, "seed": 1}}
        sync = _run({**common, "mode": "sync", "scheduling": {"rollout_slots": args.slots}})
        asyn = _run({**common, "mode": "async",
                     "scheduling": {"rollout_slots": args.slots, "max_async_level": 2, "max_staleness": 2,
                                    "min_usable": args.group_size - 1, "cancel_stragglers": True,
                                    "min_accept_fraction": 0.75}})
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)
    lower = args.steps * args.train_s + (asyn["first_rollout_s"] or 0)
    print(f"workload: {args.steps} steps x {args.tasks_per_step} groups x {args.group_size} episodes, "
          f"episodes lognormal(median {args.median_s}s, sigma {args.sigma}), train step {args.train_s}s")
    for name, r in (("sync", sync), ("async", asyn)):
        print(f"{name:>5}: wall {r['wall_s']:.1f}s  trainer busy {r['busy']:.3f}  staleness max {r['staleness_max']} "
              f"{r['staleness_hist']}  groups {r['groups']}  episodes {r['episodes']} (cancelled {r['cancelled']})")
    print(f"lower bound (N steps back to back + first step's rollout {asyn['first_rollout_s']:.1f}s): {lower:.1f}s")
    print(f"async wall / lower bound: {asyn['wall_s'] / lower:.3f}   (goal <= 1.10)")
    print(f"sync / async wall-time ratio: {sync['wall_s'] / asyn['wall_s']:.2f}x   (AReaL reports 2.77x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
