"""Recovery after a fault, mid-run: killed workers, a Redis restart (with or without its data), a
start on a full var disk, a database blip at a closing write, beat killed, a worker stopped past
its lease.

A real stack on a private Redis server (started here, on a free port, its dump file in the bench's
folder) and a fresh PostgreSQL database (dropped at the end; `--sqlite` for a SQLite file, where
the `db` fault is skipped): the `cpu` worker (control, prepare, grade), two `rollout` workers and
`celery beat` running the watchdog.  The run is a simulated eval run (the stages sleep; the
queues, leases, claims and SQL are the production path).  For each fault the bench starts a run,
waits for a stage to be in the state it means to break, does the fault, restarts what a process
supervisor would restart at once (`workers/launch.py`), and measures:

  recovered_s   fault -> the first sign of recovery: an episode re-dispatched by the watchdog
                (leases), the Redis state rebuilt (Redis lost), the start finished (full disk)
  finish_s      fault -> the run is `completed`                          (goal: <= 120 s)
  completed     every episode completed, exactly once (no row lost, duplicated or stuck)
  redone        stages run again: re-dispatches plus rollout attempts past the first
                (goal after a database or Redis blip: 0)

Faults:
  rollout     SIGKILL of the rollout worker holding a running episode (restarted at once)
  prepare     SIGKILL of the cpu worker mid-prepare (restarted at once)
  redis       SHUTDOWN NOSAVE of Redis mid-rollout, started again at once without its data
  redis-kept  SHUTDOWN SAVE of Redis mid-rollout, started again at once with its data
  start-disk  the var folder (a tmpfs) full while the run starts; the clock starts when the file
              filling it is deleted (needs mount(8) rights; skipped otherwise)
  db          PostgreSQL drops and refuses connections for `--db-outage-s`, from 2 s before a
              rollout ends (so the rollout's closing write meets the outage)
  beat        SIGKILL of beat and of the rollout worker holding a running episode (both restarted
              at once): a lost rollout with a freshly started beat
  sigstop     SIGSTOP of the rollout worker holding a running episode, SIGCONT once its stages
              were taken over by the other rollout worker (at most lease + 4 watchdog periods)

The lease and watchdog periods are the bench's `--lease-s` and `--watchdog-s` (10 s and 5 s, the
settings the faults were first measured with), passed to every process of the stack.

    .venv/bin/python bench/recovery.py [--faults rollout,prepare,...] [--episode-s 20] [--sqlite]
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
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # support.faults: the database outage the tests use

ALL_FAULTS = "rollout,prepare,redis,redis-kept,start-disk,db,beat,sigstop"
WORKER = [sys.executable, "-m", "celery", "-A", "app", "worker", "--without-heartbeat", "--without-mingle",
          "--without-gossip", "-O", "fair", "--loglevel", "WARNING"]
ROLLOUT_WORKERS = ("rollout", "rollout2")


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

    def start(self, name: str, keep_data: bool = False) -> None:
        if name == "redis":
            if not keep_data:
                (self.tmp / "dump.rdb").unlink(missing_ok=True)
            self._start("redis", ["redis-server", "--port", str(self.redis_port), "--save", "", "--appendonly", "no",
                                  "--bind", "127.0.0.1", "--dir", str(self.tmp), "--dbfilename", "dump.rdb"])
            import redis

            client = redis.Redis(port=self.redis_port)
            for _ in range(200):
                try:
                    client.ping()
                    return
                except (redis.ConnectionError, redis.exceptions.BusyLoadingError):
                    time.sleep(0.05)
            raise SystemExit("redis-server did not start")
        if name == "cpu":
            self._start(name, [*WORKER, "-Q", "control,prepare,grade", "-c", "3", "-n", "bench-cpu@%h"])
        elif name in ROLLOUT_WORKERS:
            self._start(name, [*WORKER, "-Q", "rollout", "-c", "2", "-n", f"bench-{name}@%h"])
        elif name == "beat":
            self._start(name, [sys.executable, "-m", "celery", "-A", "app", "beat", "--loglevel", "INFO",
                               "-s", str(self.tmp / "celerybeat-schedule")])

    def supervise(self) -> None:
        for name, proc in list(self.procs.items()):
            if name != "redis" and proc.poll() is not None:
                self.restarts.append(f"{name} exited {proc.returncode}")
                self.start(name)

    def kill(self, name: str, save: bool = False) -> None:
        proc = self.procs.pop(name)
        if name == "redis":
            import redis

            try:
                redis.Redis(port=self.redis_port).shutdown(save=save, nosave=not save)
            except redis.ConnectionError:
                pass
            proc.wait(timeout=30)
            return
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def holder_of(self, owner: str | None) -> str | None:
        """The stack process whose pool child holds lease `owner` (`host:pid:nonce`)."""
        try:
            pgid = os.getpgid(int((owner or "").split(":")[1]))
        except (IndexError, ValueError, ProcessLookupError):
            return None
        return next((name for name, proc in self.procs.items() if proc.pid == pgid), None)

    def stop(self) -> None:
        for name in list(self.procs):
            if name != "redis":
                for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped process dies on SIGKILL too; CONT is tidy
                    try:
                        os.killpg(self.procs[name].pid, sig)
                    except ProcessLookupError:
                        pass
                self.procs.pop(name).wait(timeout=10)
        if "redis" in self.procs:
            self.kill("redis")


def _create_run(args) -> int:
    from app.db import session_scope
    from app.runconfig import RunConfig
    from app.tables import Run
    from app.tasks.send import send_start_run

    cfg = RunConfig.model_validate({"kind": "eval", "group_size": args.episodes // 2, "tasks_per_step": 2,
                                    "simulate": {"episode_median_s": args.episode_s, "episode_sigma": 0.0,
                                                 "prepare_s": args.prepare_s},
                                    "scheduling": {"rollout_slots": 4, "ready_depth": 2}})
    with session_scope() as s:
        run = Run(kind=cfg.kind, config=cfg.model_dump(mode="json"))
        s.add(run)
        s.flush()
        run_id = run.id
    send_start_run(run_id, 9)
    return run_id


def _snapshot(run_id: int) -> dict | None:
    """The run's status, summary and episodes; None while the database cannot be read."""
    from sqlalchemy import select

    from app.db import session_scope
    from app.retry import TRANSIENT_ERRORS
    from app.tables import Episode, Run

    try:
        with session_scope() as s:
            run = s.get(Run, run_id)
            eps = s.scalars(select(Episode).where(Episode.run_id == run_id)).all()
            return {"run": run.status, "summary": dict(run.summary or {}), "episodes": [
                {"id": e.id, "status": e.status, "owner": e.lease_owner, "redeliveries": e.redeliveries,
                 "attempts": e.attempts, "started_at": e.started_at} for e in eps]}
    except TRANSIENT_ERRORS:
        return None


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


def _held(run_id: int, state: str, stack: Stack, holders=None):
    """A snapshot episode of `run_id` in `state` whose lease a live stack process (one of
    `holders`) holds, or None."""
    snap = _snapshot(run_id) or {"episodes": []}
    for ep in snap["episodes"]:
        name = stack.holder_of(ep["owner"]) if ep["status"] == state else None
        if name and (holders is None or name in holders):
            return ep, name
    return None


def _marker_back() -> bool:
    from app.control import redis_state

    try:
        return redis_state.has_marker()
    except Exception:  # noqa: BLE001 - Redis still coming back
        return False


def _rollout_retries(stack: Stack) -> int:
    """Closing writes the rollout workers retried through an outage so far (their log lines)."""
    return sum((stack.tmp / f"{name}.log").read_text(errors="replace").count("event=retry what=episode")
               for name in ROLLOUT_WORKERS if (stack.tmp / f"{name}.log").exists())


def inject(fault: str, stack: Stack, args, later: list) -> tuple[int, float]:
    """Start a run, break it with `fault`; returns (run id, monotonic time of the fault).  Actions
    due later in the fault (SIGCONT, the database's return) are appended to `later` as
    `(monotonic time or predicate, callable)`."""
    from support.faults import cut_database, restore_database

    if fault == "start-disk":
        fill = Path(args.var) / "fill"
        subprocess.run(["dd", "if=/dev/zero", f"of={fill}", "bs=64k"], capture_output=True)  # ends at ENOSPC
        run_id = _create_run(args)
        _wait(lambda: (_snapshot(run_id) or {}).get("summary", {}).get("start_error"), 120, "the start to fail")
        time.sleep(args.watchdog_s)  # the watchdog's re-sends meet the full disk too
        fill.unlink()
        return run_id, time.monotonic()
    run_id = _create_run(args)
    if fault == "prepare":
        _wait(lambda: _held(run_id, "preparing", stack), 120, "an episode preparing in the cpu worker")
        time.sleep(1.0)
        stack.kill("cpu")
        stack.start("cpu")
        return run_id, time.monotonic()
    ep, holder = _wait(lambda: _held(run_id, "running", stack, ROLLOUT_WORKERS), 120,
                       "an episode running in a rollout worker")
    if fault == "db":
        from app.tables import aware_utc

        ends = aware_utc(ep["started_at"]).timestamp() + args.episode_s
        time.sleep(max(0.0, ends - 2.0 - time.time()))
        from app.db import dispose_engine

        dispose_engine()
        cut_database(args.database_url)
        t_fault = time.monotonic()
        later.append((t_fault + args.db_outage_s, lambda: restore_database(args.database_url)))
        return run_id, t_fault
    time.sleep(1.0)
    if fault in ("redis", "redis-kept"):
        stack.kill("redis", save=fault == "redis-kept")
        stack.start("redis", keep_data=fault == "redis-kept")
    elif fault in ("rollout", "beat"):
        stack.kill(holder)
        if fault == "beat":
            stack.kill("beat")
            stack.start("beat")
        stack.start(holder)
    elif fault == "sigstop":
        pid = stack.procs[holder].pid
        os.killpg(pid, signal.SIGSTOP)
        t_fault = time.monotonic()
        stolen = {e["id"] for e in (_snapshot(run_id) or {"episodes": []})["episodes"]
                  if stack.holder_of(e["owner"]) == holder}

        def taken_over() -> bool:
            snap = _snapshot(run_id)
            return snap is not None and all(
                e["redeliveries"] > 0 and e["owner"] and stack.holder_of(e["owner"]) != holder
                or e["status"] not in ("preparing", "running", "grading")
                for e in snap["episodes"] if e["id"] in stolen)

        later.append((taken_over, lambda: os.killpg(pid, signal.SIGCONT)))
        later.append((t_fault + args.lease_s + 4 * args.watchdog_s, lambda: os.killpg(pid, signal.SIGCONT)))
        return run_id, t_fault
    else:
        raise SystemExit(f"unknown fault {fault!r} (known: {ALL_FAULTS})")
    return run_id, time.monotonic()


def one_fault(stack: Stack, fault: str, args) -> dict:
    """Run one simulated eval run, break it with `fault` mid-stage, return the measured times."""
    later: list = []
    retries_before = _rollout_retries(stack)
    run_id, t_fault = inject(fault, stack, args, later)
    recovered = None
    snap = None
    while True:
        now = time.monotonic()
        for item in list(later):
            due, action = item
            if (due() if callable(due) else now >= due):
                action()
                later = [x for x in later if x[1] is not action]
        got = _snapshot(run_id)
        snap = got or snap
        if got is not None and recovered is None and (
                any(e["redeliveries"] > 0 for e in got["episodes"])
                or (fault == "redis" and _marker_back())
                or (fault == "start-disk" and "instance_ids" in got["summary"])):
            recovered = time.monotonic() - t_fault
        if got is not None and got["run"] in ("completed", "failed", "cancelled") and not later:
            break
        stack.supervise()
        if time.monotonic() - t_fault > args.give_up_s:
            for _, action in later:
                action()
            break
        time.sleep(0.2)
    finished = time.monotonic() - t_fault
    episodes = snap["episodes"]
    restarted, stack.restarts = stack.restarts, []
    return {"fault": fault, "run": snap["run"], "recovered_s": recovered,
            "finish_s": finished if snap["run"] in ("completed", "failed", "cancelled") else None,
            "episodes": len(episodes), "completed": sum(e["status"] == "completed" for e in episodes),
            "redeliveries": sum(e["redeliveries"] for e in episodes),
            "extra_attempts": sum(max(0, e["attempts"] - 1) for e in episodes),
            "closing_writes_retried": _rollout_retries(stack) - retries_before,
            "start_failures": snap["summary"].get("start_failures", 0), "crashed_and_restarted": restarted}


def _database(args) -> tuple[str, callable]:
    """The bench's database URL and a function that drops it."""
    if args.sqlite:
        return f"sqlite:///{args.tmp}/bench.db", lambda: None
    from sqlalchemy import create_engine, text
    from support.faults import PG_ADMIN_URL

    name = f"turnstile_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true'))
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}", drop


def _mount_var(var: Path) -> bool:
    var.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(var)],
                          capture_output=True).returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", default=ALL_FAULTS)
    parser.add_argument("--episodes", type=int, default=8, help="episodes of the run (two groups)")
    parser.add_argument("--episode-s", type=float, default=20.0, help="simulated rollout length, s")
    parser.add_argument("--prepare-s", type=float, default=5.0, help="simulated prepare length, s")
    parser.add_argument("--lease-s", type=float, default=10.0, help="TURNSTILE_LEASE_TTL_S of the stack")
    parser.add_argument("--watchdog-s", type=float, default=5.0, help="TURNSTILE_WATCHDOG_INTERVAL_S of the stack")
    parser.add_argument("--db-outage-s", type=float, default=5.0, help="length of the `db` fault's outage, s")
    parser.add_argument("--give-up-s", type=float, default=300.0)
    parser.add_argument("--sqlite", action="store_true", help="a SQLite file instead of PostgreSQL (no `db` fault)")
    args = parser.parse_args()
    faults = args.faults.split(",")
    unknown = set(faults) - set(ALL_FAULTS.split(","))
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)} (known: {ALL_FAULTS})")

    args.tmp = tmp = Path(tempfile.mkdtemp(prefix="turnstile-recovery-"))
    args.var = tmp / "var"
    mounted = "start-disk" in faults and _mount_var(args.var)
    skipped = []
    if "start-disk" in faults and not mounted:
        skipped.append("start-disk (cannot mount a tmpfs for the var folder)")
    if "db" in faults and args.sqlite:
        skipped.append("db (SQLite has no connection to drop)")
    faults = [f for f in faults if not any(s.startswith(f + " ") for s in skipped)]
    args.database_url, drop_database = _database(args)
    port = _free_port()
    env = {**os.environ, "DATABASE_URL": args.database_url, "REDIS_URL": f"redis://127.0.0.1:{port}/0",
           "TURNSTILE_VAR_DIR": str(args.var), "PYTHONPATH": str(ROOT),
           "TURNSTILE_LEASE_TTL_S": f"{args.lease_s:g}", "TURNSTILE_WATCHDOG_INTERVAL_S": f"{args.watchdog_s:g}"}
    os.environ.update({k: env[k] for k in ("DATABASE_URL", "REDIS_URL", "TURNSTILE_VAR_DIR", "TURNSTILE_LEASE_TTL_S",
                                           "TURNSTILE_WATCHDOG_INTERVAL_S")})
    from app.db import get_engine, dispose_engine
    from app.tables import Base

    Base.metadata.create_all(get_engine())
    stack = Stack(tmp, env, port)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the stack on SIGTERM too
    results = []
    try:
        for name in ("redis", "cpu", *ROLLOUT_WORKERS, "beat"):
            stack.start(name)
        time.sleep(3)
        for fault in faults:
            results.append(one_fault(stack, fault, args))
            print(results[-1], flush=True)
    finally:
        stack.stop()
        dispose_engine()
        drop_database()
        if mounted:
            subprocess.run(["umount", "-l", str(args.var)], check=False)
    print(f"\n{'PostgreSQL' if not args.sqlite else 'SQLite'}, lease {args.lease_s:g} s, watchdog every "
          f"{args.watchdog_s:g} s, {args.episodes} episodes of {args.episode_s:g} s (prepare {args.prepare_s:g} s), "
          f"logs in {tmp}")
    for line in skipped:
        print("skipped:", line)
    print(f"{'fault':<11} {'finished':<10} {'recovered s':>11} {'finish s':>9}  {'completed once':<15} work redone")
    for r in results:
        once = r["completed"] == r["episodes"] == args.episodes
        recovered = "-" if r["recovered_s"] is None else f"{r['recovered_s']:.1f}"
        finish = "-" if r["finish_s"] is None else f"{r['finish_s']:.1f}"
        completed = f"{'yes' if once else 'NO'} ({r['completed']}/{r['episodes']})"
        print(f"{r['fault']:<11} {r['run']:<10} {recovered:>11} {finish:>9}  {completed:<15} "
              f"{r['redeliveries']} re-dispatched, {r['extra_attempts']} rollouts again")
    blips = ("db", "redis-kept")
    ok = all(r["run"] == "completed" and r["finish_s"] is not None and r["finish_s"] <= 120
             and r["completed"] == r["episodes"] == args.episodes
             and (r["fault"] not in blips or r["redeliveries"] + r["extra_attempts"] == 0) for r in results)
    print("goal (finished within 120 s of the fault, every episode completed once, nothing redone after a "
          "database or Redis blip):", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
