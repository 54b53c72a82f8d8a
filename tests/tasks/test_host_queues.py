"""Per-host rollout queues: a runtime prepared on one machine is rolled out on that machine only.

The runtime is on the preparing machine's disk, so the rollout message goes to that machine's
queue (`rollout.<TURNSTILE_HOST_NAME>`, app.celery's router) and a rollout worker consumes its
own machine's queue besides the shared one.  Real Redis broker, real Celery workers; the two
"machines" are two host names (the multi-host test gives each its own network namespace)."""
from __future__ import annotations

from sqlalchemy import select

from app import config
from app.celery import app as celery_app
from app.control import episodes, lease, runs
from app.control.plan import Plan
from app.db import session_scope
from app.tables import Episode, Run
from app.tasks.send import send
from support import REDIS_BASE, celery_worker_args, wait_for

REDIS_DB = 10
RUN = {"kind": "eval", "group_size": 2, "tasks_per_step": 1, "simulate": {"episode_median_s": 0.05, "episode_sigma": 0},
       "scheduling": {"rollout_slots": 2, "ready_depth": 2}}


def _prepared_on(monkeypatch, hosts: list[str]) -> tuple[int, dict[str, int], list[int]]:
    """A simulated run whose episodes are prepared in this process, episode i as if on hosts[i];
    returns the run id, {host: episode id} and the rollouts the scheduler planned (not yet sent)."""
    with session_scope() as s:
        run = Run(kind="eval", status="queued", config=RUN)
        s.add(run)
        s.flush()
        run_id = run.id
    prepare = runs.start_run(run_id).prepare
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert len(prepare) == len(hosts), (run.status, run.error)
    by_host, rollouts = {}, []
    for host, episode_id in zip(hosts, prepare):
        monkeypatch.setenv("TURNSTILE_HOST_NAME", host)
        config.reset_settings()
        rollouts += episodes.prepare(episode_id).rollout
        by_host[host] = episode_id
    monkeypatch.delenv("TURNSTILE_HOST_NAME")
    config.reset_settings()
    return run_id, by_host, rollouts


def _route(episode_id: int) -> str:
    return celery_app.amqp.router.route({}, "rollout.run_episode", args=[episode_id])["queue"].name


def _waiting(redis_db, queue: str) -> int:
    """Messages waiting in a kombu Redis queue (one list per priority step: `queue`, `queue:N`)."""
    return sum(redis_db.llen(k) for k in redis_db.keys(f"{queue}*") if k.decode() in
               {queue, *(f"{queue}:{n}" for n in range(10))})


def test_a_rollout_is_routed_to_the_host_that_prepared_its_runtime(database, redis_db, monkeypatch):
    run_id, by_host, rollouts = _prepared_on(monkeypatch, ["host-a", "host-b"])
    assert sorted(rollouts) == sorted(by_host.values())
    with session_scope() as s:
        assert {s.get(Episode, i).runtime["host"] for i in by_host.values()} == {"host-a", "host-b"}
    assert _route(by_host["host-a"]) == "rollout.host-a" and _route(by_host["host-b"]) == "rollout.host-b"

    send(Plan(rollout=rollouts))
    assert _waiting(redis_db, "rollout.host-a") == 1 and _waiting(redis_db, "rollout.host-b") == 1
    assert _waiting(redis_db, "rollout") == 0
    # A second attempt (the first was lost with its worker) prepares a fresh runtime wherever it
    # runs: it goes to the shared queue.
    with session_scope() as s:
        assert lease.claim(s, by_host["host-a"], "running", "dead:1:x", attempts=1)
    assert _route(by_host["host-a"]) == "rollout"
    assert _route(123456) == "rollout"  # no such episode: no host recorded


def test_another_host_never_claims_it(database, redis_db, monkeypatch, spawn):
    """A rollout worker on host-b runs host-b's episode and leaves host-a's alone; host-a's
    worker, started later, takes it."""
    run_id, by_host, rollouts = _prepared_on(monkeypatch, ["host-a", "host-b"])

    send(Plan(rollout=rollouts))
    env = {"DATABASE_URL": database, "REDIS_URL": f"{REDIS_BASE}/{REDIS_DB}"}
    worker_b = spawn(celery_worker_args("rollout", concurrency=1, name="rb"), {**env, "TURNSTILE_HOST_NAME": "host-b"},
                     name="rollout-b")

    def status(episode_id):
        with session_scope() as s:
            return s.get(Episode, episode_id).status

    wait_for(lambda: status(by_host["host-b"]) in ("grading", "completed"), 90, interval=0.3,
             what=f"host-b's rollout\n{worker_b.output()[-3000:]}")
    assert "rollout.host-b" in worker_b.output()  # the worker's queue list names its host's queue
    with session_scope() as s:
        a = s.get(Episode, by_host["host-a"])
        assert (a.status, a.attempts, a.lease_owner) == ("running", 0, None)  # never claimed by host-b
    assert _waiting(redis_db, "rollout.host-a") == 1
    assert f"episode={by_host['host-a']} " not in worker_b.output()
    worker_a = spawn(celery_worker_args("rollout", concurrency=1, name="ra"), {**env, "TURNSTILE_HOST_NAME": "host-a"},
                     name="rollout-a")
    wait_for(lambda: status(by_host["host-a"]) in ("grading", "completed"), 90, interval=0.3,
             what=f"host-a's rollout\n{worker_a.output()[-3000:]}")
    assert f"episode={by_host['host-a']} event=rollout attempt=1" in worker_a.output()
    with session_scope() as s:
        assert s.scalar(select(Episode.attempts).where(Episode.id == by_host["host-a"])) == 1
