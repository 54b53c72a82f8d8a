"""Recovery after a crash: kill -9 of a worker mid-stage, or a Redis restart, mid-run.

A real stack on a private Redis server (started here, on a free port, without persistence, so a
restart loses every key like a crashed Redis) and a SQLite file: the `cpu` worker (control,
prepare, grade), the `rollout` worker, and `celery beat` running the watchdog.  The run is a
simulated eval run (the stages sleep; the queues, leases, claims and SQL are the production
path).  For each fault the bench waits for a stage to be in the state it means to break, does
the fault, restarts what a process supervisor would restart at once, and measures:

  to_redispatch_s  fault -> the first episode re-dispatched by the watchdog (leases) or the
                   Redis state rebuilt (restart)
  to_finish_s      fault -> the run is `completed`                 (goal: <= 120 s)
  and checks: every episode completed exactly once (no row lost, duplicated or stuck).

Faults: `rollout` (SIGKILL of the rollout worker's process group mid-episode), `prepare`
(SIGKILL of the cpu worker mid-prepare), `redis` (SHUTDOWN NOSAVE of Redis mid-run, started
again at once on the same port).  The lease and watchdog timings are the settings in effect
(TURNSTILE_LEASE_TTL_S, TURNSTILE_WATCHDOG_INTERVAL_S; defaults 30 s and 30 s).

    .venv/bin/python bench/recovery.py [--faults rollout,prepare,redis] [--episode-s 20]
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKER = [sys.executable, "-m", "celery", "-A", "app", "worker", "--without-heartbeat", "--without-mingle",
          "--without-gossip", "-O", "fair", "--loglevel", "WARNING"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Stack:
    """Private Redis + workers + beat; `supervise()` restarts a process that exited, as the
    Procfile's launcher does (`workers/launch.py`)."""

    def __init__(self, tmp: Path, env: dict, redis_port: int) -> None:
        self.tmp, self.env, self.redis_port = tmp, env, redis_port
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: list[str] = []

    def _start(self, name: str, args: list[str]) -> None:
        log = open(self.tmp / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(args, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def start(self, name: str) -> None:
        if name == "redis":
            self._start("redis", ["redis-server", "--port", str(self.redis_port), "--save", "", "--appendonly", "no",
                                  "--bind", "127.0.0.1"])
            import redis

            client = redis.Redis(port=self.redis_port)
            for _ in range(100):
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    time.sleep(0.05)
            raise SystemExit("redis-server did not start")
        if name == "cpu":
            self._start(name, [*WORKER, "-Q", "control,prepare,grade", "-c", "3", "-n", "bench-cpu@%h"])
        elif name == "rollout":
            self._start(name, [*WORKER, "-Q", "rollout", "-c", "4", "-n", "bench-rollout@%h"])
        elif name == "beat":
            self._start(name, [sys.executable, "-m", "celery", "-A", "app", "beat", "--loglevel", "WARNING",
                               "-s", str(self.tmp / "celerybeat-schedule")])

    def supervise(self) -> None:
        for name, proc in list(self.procs.items()):
            if name != "redis" and proc.poll() is not None:
                self.restarts.append(f"{name} exited {proc.returncode}")
                self.start(name)

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        if name == "redis":
            import redis

            try:
                redis.Redis(port=self.redis_port).shutdown(nosave=True)
            except redis.ConnectionError:
                pass
            proc.wait(timeout=10)
            return
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        for name in list(self.procs):
            if name != "redis":
                os.killpg(self.procs[name].pid, signal.SIGKILL)
                self.procs.pop(name).wait(timeout=10)
        if "redis" in self.procs:
            self.kill("redis")


def _create_run(episodes: int, episode_s: float, prepare_s: float) -> int:
    from app.celery import app as celery_app
    from app.db import session_scope
    from app.tables import Run
    from app.runconfig import RunConfig

    cfg = RunConfig.model_validate({"kind": "eval", "group_size": episodes // 2, "tasks_per_step": 2,
                                    "simulate": {"episode_median_s": episode_s, "prepare_s": prepare_s},
                                    "scheduling": {"rollout_slots": 4, "ready_depth": 2}})
    with session_scope() as s:
        run = Run(kind=cfg.kind, config=cfg.model_dump(mode="json"))
        s.add(run)
        s.flush()
        run_id = run.id
    celery_app.send_task("control.start_run", args=[run_id])
    return run_id


def _snapshot(run_id: int) -> dict:
    from sqlalchemy import select

    from app.db import session_scope
    from app.tables import Episode, Run

    with session_scope() as s:
        eps = s.scalars(select(Episode).where(Episode.run_id == run_id)).all()
        return {"run": s.get(Run, run_id).status, "episodes": [
            (e.id, e.status, e.lease_owner, e.redeliveries, e.attempts) for e in eps]}


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


def one_fault(stack: Stack, fault: str, args) -> dict:
    """Run one simulated eval run, break it with `fault` mid-stage, return the measured times."""
    run_id = _create_run(args.episodes, args.episode_s, args.prepare_s)
    target = {"rollout": "running", "prepare": "preparing", "redis": "running"}[fault]
    _wait(lambda: any(st == target and owner for _, st, owner, _, _ in _snapshot(run_id)["episodes"]), 120,
          f"an episode {target} in a worker")
    time.sleep(1.0)
    if fault == "redis":
        stack.kill("redis")
        stack.start("redis")
    else:
        name = "rollout" if fault == "rollout" else "cpu"
        stack.kill(name)
        stack.start(name)  # a supervisor restarts the process at once
    t_fault = time.monotonic()
    redispatch = None
    while True:
        snap = _snapshot(run_id)
        if redispatch is None and (any(r > 0 for *_, r, _ in snap["episodes"]) or
                                   (fault == "redis" and _marker_back())):
            redispatch = time.monotonic() - t_fault
        if snap["run"] in ("completed", "failed", "cancelled"):
            break
        stack.supervise()
        if time.monotonic() - t_fault > args.give_up_s:
            return {"fault": fault, "run": snap["run"], "to_redispatch_s": redispatch, "to_finish_s": None,
                    "episodes": snap["episodes"]}
        time.sleep(0.2)
    finished = time.monotonic() - t_fault
    statuses = [st for _, st, *_ in snap["episodes"]]
    restarted, stack.restarts = stack.restarts, []
    return {"fault": fault, "run": snap["run"], "to_redispatch_s": redispatch, "to_finish_s": finished,
            "episodes": len(statuses), "completed": statuses.count("completed"),
            "redeliveries": sum(r for *_, r, _ in snap["episodes"]),
            "attempts_max": max(a for *_, a in snap["episodes"]), "crashed_and_restarted": restarted}


def _marker_back() -> bool:
    from app.control import redis_state

    try:
        return redis_state.has_marker()
    except Exception:  # noqa: BLE001 - Redis still coming back
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", default="rollout,prepare,redis")
    parser.add_argument("--episodes", type=int, default=8, help="episodes of the run (two groups)")
    parser.add_argument("--episode-s", type=float, default=20.0, help="simulated rollout length, s")
    parser.add_argument("--prepare-s", type=float, default=5.0, help="simulated prepare length, s")
    parser.add_argument("--give-up-s", type=float, default=300.0)
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="turnstile-recovery-"))
    port = _free_port()
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp}/bench.db", "REDIS_URL": f"redis://127.0.0.1:{port}/0",
           "TURNSTILE_VAR_DIR": str(tmp / "var"), "PYTHONPATH": str(ROOT)}
    os.environ.update({k: env[k] for k in ("DATABASE_URL", "REDIS_URL", "TURNSTILE_VAR_DIR")})
    from app.config import get_settings
    from app.db import get_engine
    from app.tables import Base

    Base.metadata.create_all(get_engine())
    settings = get_settings()
    stack = Stack(tmp, env, port)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the stack on SIGTERM too
    results = []
    try:
        for name in ("redis", "cpu", "rollout", "beat"):
            stack.start(name)
        time.sleep(3)
        for fault in args.faults.split(","):
            results.append(one_fault(stack, fault, args))
            print(results[-1], flush=True)
    finally:
        stack.stop()
    print(f"\nlease ttl {settings.lease_ttl_s:g} s, watchdog every {settings.watchdog_interval_s:g} s, "
          f"{args.episodes} episodes of {args.episode_s:g} s (prepare {args.prepare_s:g} s), logs in {tmp}")
    print(f"{'fault':<8} {'run':<10} {'redispatch s':>12} {'finish s':>9}  episodes completed/total, redeliveries")
    for r in results:
        print(f"{r['fault']:<8} {r['run']:<10} {r['to_redispatch_s'] or float('nan'):>12.1f} "
              f"{r['to_finish_s'] or float('nan'):>9.1f}  {r.get('completed')}/{r.get('episodes')}, "
              f"{r.get('redeliveries')}")
    ok = all(r["run"] == "completed" and r["to_finish_s"] is not None and r["to_finish_s"] <= 120
             and r["completed"] == r["episodes"] == args.episodes for r in results)
    print("goal (finished within 120 s of the fault, every episode completed once):", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
