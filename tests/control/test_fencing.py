"""Fencing on real processes: a rollout worker stopped (SIGSTOP) past its lease loses the stage to
another worker, and once continued (SIGCONT) it writes nothing; the episode completes once, with
the second attempt's rollout.

PostgreSQL (the production database; SQLite's single writer would serialize the race away).
The stopped process is the whole worker (its main process and its pool child), as a stalled
machine or a paused container is.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
from sqlalchemy import select

from app.control import watchdog
from app.db import session_scope
from app.tables import Episode, Run, aware_utc
from support import celery_worker_args, wait_for
from support.faults import postgres_process_env

REDIS_DB = 10
EPISODE_S = 8.0


@pytest.fixture
def postgres(pg_url, monkeypatch, tmp_path):
    """A fresh PostgreSQL database; leases of 6 s renewed every second (room for a loaded box)."""
    yield from postgres_process_env(pg_url, monkeypatch, tmp_path, TURNSTILE_LEASE_TTL_S="6",
                                    TURNSTILE_LEASE_RENEW_S="1")


def _owner_pgid(owner: str | None) -> int | None:
    """The process group (= the worker's main pid, spawned in its own session) of a lease owner
    `host:pid:nonce`, or None when no live process holds it."""
    if not owner:
        return None
    try:
        return os.getpgid(int(owner.split(":")[1]))
    except ProcessLookupError:
        return None


def _episode(run_id: int) -> Episode | None:
    with session_scope() as s:
        return s.scalar(select(Episode).where(Episode.run_id == run_id))


def _reap() -> None:
    """One watchdog pass over leases (what beat's pass does), sending what it plans."""
    from app.tasks.send import send

    plans, _ = watchdog.recover_episodes(None)
    for plan in plans:
        send(plan)


def test_a_worker_stopped_past_its_lease_loses_the_stage_and_writes_nothing_on_sigcont(postgres, redis_db, spawn):
    from app.tasks.send import send_start_run

    cpu = spawn(celery_worker_args("control,prepare,grade", concurrency=2), postgres, name="cpu")
    rollout_workers = [spawn(celery_worker_args("rollout", concurrency=1), postgres, name=f"rollout{i}")
                       for i in range(2)]
    with session_scope() as s:
        run = Run(kind="eval", status="queued", config={
            "kind": "eval", "group_size": 1, "tasks_per_step": 1,
            "simulate": {"episode_median_s": EPISODE_S, "episode_sigma": 0.0}})
        s.add(run)
        s.flush()
        run_id = run.id
    send_start_run(run_id, 9)

    def logs() -> str:
        return "\n".join(f"--- {w.log_path.name}\n{w.output()[-3000:]}" for w in [cpu, *rollout_workers])

    def first_attempt_held():
        ep = _episode(run_id)
        return ep if ep is not None and ep.status == "running" and ep.attempts == 1 and _owner_pgid(ep.lease_owner) \
            else None

    first = wait_for(first_attempt_held, 90, what=lambda: f"the first attempt to start\n{logs()}")
    stopped = next(w for w in rollout_workers if w.popen.pid == _owner_pgid(first.lease_owner))
    other = next(w for w in rollout_workers if w is not stopped)
    time.sleep(0.5)
    os.killpg(stopped.popen.pid, signal.SIGSTOP)
    try:
        def taken_over():
            _reap()
            ep = _episode(run_id)
            return ep if ep.attempts == 2 and _owner_pgid(ep.lease_owner) == other.popen.pid else None

        second = wait_for(taken_over, 60, interval=0.5, what=lambda: f"another worker to take the rollout over\n{logs()}")
    finally:
        os.killpg(stopped.popen.pid, signal.SIGCONT)  # while the second attempt still runs
    assert second.status == "running" and second.redeliveries == 1
    stopped_output = stopped.output()

    def stopped_stage_returned():
        return stopped.output().count("rollout.run_episode[") > stopped_output.count("rollout.run_episode[")

    wait_for(stopped_stage_returned, 30, what=lambda: f"the continued worker's stage to return\n{logs()}")

    def finished():
        _reap()
        with session_scope() as s:
            return s.get(Run, run_id).status in ("completed", "failed")

    wait_for(finished, 60, interval=0.5, what=lambda: f"the run to finish\n{logs()}")
    ep = _episode(run_id)
    with session_scope() as s:
        assert s.get(Run, run_id).status == "completed"
    assert (ep.status, ep.attempts, ep.redeliveries) == ("completed", 2, 1), (ep.status, ep.attempts,
                                                                              ep.redeliveries, ep.error)
    # The rollout that reached grading is the second attempt's, run to its end: the continued
    # worker's rollout (its deadline long past) returned at once, and had its write landed, the
    # episode would have left `running` within a second of the second attempt's start.
    ran = (aware_utc(ep.rollout_finished_at) - aware_utc(ep.started_at)).total_seconds()
    assert ran >= EPISODE_S - 0.5, f"the stopped worker's rollout was recorded ({ran:.1f} s after attempt 2 began)"
    assert ep.exit_status == "submitted"
    assert stopped.popen.poll() is None and other.popen.poll() is None, logs()
