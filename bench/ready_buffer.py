"""READY buffer vs none: how long a free rollout slot waits for a prepared runtime.

Eight simulated episodes whose runtimes take several seconds to prepare run on two
rollout slots through the real Celery queues on Redis.  With a READY buffer
(`ready_depth` 2) runtimes are prepared ahead and a slot released by a finished
rollout is refilled at once; without one (`ready_depth` 0) preparation only starts
when a slot is already free.  Prints the measured waits (slot freed -> next rollout
started) and wall times of both, side by side.

    .venv/bin/python bench/ready_buffer.py [--prepare-s 3] [--episode-s 2]
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


def _run(config: dict) -> dict:
    from app import create_app
    from app.control import redis_state
    from app.db import session_scope
    from app.tables import Run

    from app.auth import auth_header

    resp = create_app().test_client().post("/api/runs", json=config, headers=auth_header())
    assert resp.status_code == 202, resp.get_json()
    run_id = resp.get_json()["id"]
    while True:
        with session_scope() as s:
            run = s.get(Run, run_id)
            if run.status in ("completed", "failed", "cancelled"):
                wall = (run.finished_at - run.started_at).total_seconds()
                break
        time.sleep(0.2)
    waits = redis_state.ready_waits(run_id)
    return {"status": run.status, "wall_s": wall, "waits": waits}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--prepare-s", type=float, default=3.0)
    parser.add_argument("--episode-s", type=float, default=2.0)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="turnstile-ready-")
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp}/bench.db", "REDIS_URL": "redis://127.0.0.1:6379/8",
           "PYTHONPATH": str(ROOT)}
    os.environ.update({k: env[k] for k in ("DATABASE_URL", "REDIS_URL")})
    import redis

    redis.Redis.from_url(env["REDIS_URL"]).flushdb()
    from app.db import get_engine
    from app.tables import Base

    Base.metadata.create_all(get_engine())
    base = [sys.executable, "-m", "celery", "-A", "app", "worker", "--without-heartbeat", "--without-mingle",
            "--without-gossip", "-O", "fair", "--loglevel", "WARNING"]
    procs = [subprocess.Popen([*base, "-Q", q, "-c", str(c), "-n", f"ready-{q.split(',')[0]}@%h"], cwd=ROOT, env=env,
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for q, c in (("control,grade", 2), ("prepare", 4), ("rollout", args.slots))]
    try:
        time.sleep(4)
        common = {"kind": "eval", "group_size": args.episodes, "tasks_per_step": 1,
                  "simulate": {"prepare_s": args.prepare_s, "episode_median_s": args.episode_s}}
        with_buffer = _run({**common, "scheduling": {"rollout_slots": args.slots, "ready_depth": 2}})
        without = _run({**common, "scheduling": {"rollout_slots": args.slots, "ready_depth": 0}})
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)

    def show(name: str, r: dict) -> None:
        w = sorted(r["waits"])
        p50 = w[len(w) // 2] if w else float("nan")
        print(f"{name:>16}: slot waits n={len(w)} p50 {p50:.3f}s max {max(w, default=float('nan')):.3f}s "
              f"mean {sum(w) / max(1, len(w)):.3f}s   wall {r['wall_s']:.1f}s")

    print(f"{args.episodes} episodes, {args.slots} rollout slots, prepare {args.prepare_s}s, episode {args.episode_s}s")
    show("READY buffer (2)", with_buffer)
    show("no buffer", without)
    mean = lambda r: sum(r["waits"]) / max(1, len(r["waits"]))  # noqa: E731
    print(f"mean slot wait ratio (no buffer / buffer): {mean(without) / max(mean(with_buffer), 1e-9):.0f}x; "
          f"wall-time ratio {without['wall_s'] / with_buffer['wall_s']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
