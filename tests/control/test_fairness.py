"""Fairness across runs on one deployment, on real Celery workers, Redis and PostgreSQL: a run with
1,000 episodes queued does not hold back another run's next step.

Each run puts at most `rollout_slots` rollout messages and `rollout_slots + ready_depth` prepare
messages on the shared queues (`app.control.scheduler._dispatch`), and at most one training step
on the gpu queue.  Queues are FIFO within a Celery priority, so a second run's message waits
behind one turnover of the first run's slots at most.  The bound asserted is the issue's: the
flood delays the small run by no more than two scheduling cycles (two turnovers of the flood's
slots), counted as the flood's rollouts started while the small run waited, not in seconds (a
loaded box stretches every duration alike).  Runs are simulated (`simulate`: stages sleep), so
the test is about the scheduling alone.
"""
from __future__ import annotations

from sqlalchemy import func, select

from app import config, create_app
from app.control import shares
from app.db import session_scope
from app.tables import Episode, Run, TrainingStep, aware_utc, utcnow
from support import api_client, celery_worker_args, wait_for
from support.faults import postgres_process_env

import pytest

REDIS_DB = 10
SLOTS, READY_DEPTH = 4, 2  # of each run


@pytest.fixture
def postgres(pg_url, monkeypatch, tmp_path):
    yield from postgres_process_env(pg_url, monkeypatch, tmp_path)


def _create(config: dict) -> int:
    resp = api_client(create_app()).post("/api/runs", json=config)
    assert resp.status_code == 202, resp.get_json()
    return resp.get_json()["id"]


def _train(tasks: int, episode_s: float) -> dict:
    return {"kind": "train", "group_size": 2, "tasks_per_step": tasks, "steps": 1, "mode": "async",
            "scheduling": {"rollout_slots": SLOTS, "ready_depth": READY_DEPTH, "max_async_level": 0},
            "simulate": {"episode_median_s": episode_s, "train_s": 0.3, "reward_p": 0.5, "seed": 1}}


def _count(run_id: int, *where) -> int:
    with session_scope() as s:
        return s.scalar(select(func.count()).select_from(Episode).where(Episode.run_id == run_id, *where))


def test_a_run_with_a_thousand_queued_episodes_does_not_hold_back_another_runs_step(postgres, redis_db, spawn):
    workers = [spawn(celery_worker_args("control,prepare,grade", concurrency=2, name="cpu"), postgres, "cpu"),
               spawn(celery_worker_args("rollout", concurrency=2, name="rollout"), postgres, "rollout"),
               spawn(celery_worker_args("gpu", concurrency=1, name="gpu"), postgres, "gpu")]

    def logs() -> str:
        return "\n".join(f"--- {w.log_path.name}\n{w.output()[-2500:]}" for w in workers)

    # 500 groups x 2: 1,000 episodes for its one step.  Its rollouts outlast a prepare, so it keeps
    # both rollout processes busy and messages waiting on the rollout queue (4 slots > 2 processes).
    flood = _create(_train(tasks=500, episode_s=1.5))
    wait_for(lambda: _count(flood, Episode.status == "completed") >= SLOTS, 120, interval=0.5,
             what=lambda: f"the flood to be under way\n{logs()}")
    small = _create(_train(tasks=1, episode_s=0.2))

    def small_done():
        with session_scope() as s:
            return s.get(Run, small).status in ("completed", "failed")

    wait_for(small_done, 120, interval=0.5, what=lambda: f"the small run to finish\n{logs()}")
    with session_scope() as s:
        assert s.get(Run, small).status == "completed"
        assert s.get(Run, flood).status == "running"
        mine = s.scalars(select(Episode).where(Episode.run_id == small)).all()
        step = s.scalar(select(TrainingStep).where(TrainingStep.run_id == small))
        started = s.get(Run, small).started_at
        theirs = s.scalars(select(Episode.started_at).where(Episode.run_id == flood,
                                                            Episode.started_at.is_not(None))).all()
        flood_steps = s.scalars(select(TrainingStep.started_at).where(TrainingStep.run_id == flood,
                                                                      TrainingStep.started_at.is_not(None))).all()
    assert step.status == "completed" and len(mine) == 2
    # Still flooded when the small run finished: most of the 1,000 episodes had not run yet.
    assert _count(flood, Episode.status.in_(("queued", "preparing", "ready"))) > 900

    # An episode is dispatched to the rollout queue the moment it is READY (its run has free
    # slots); the flood's rollouts that started while it waited there are what overtook it.
    overtaking = [sum(1 for t in theirs if aware_utc(e.prepared_at) < aware_utc(t) <= aware_utc(e.started_at))
                  for e in mine]
    whole = sum(1 for t in theirs if aware_utc(started) < aware_utc(t) <= max(aware_utc(e.started_at) for e in mine))
    print(f"\nflood rollouts started while a small-run episode waited on the rollout queue: {overtaking} "
          f"(bound: 2 cycles = {2 * SLOTS}); from the small run's start to its last rollout's: {whole}")
    assert max(overtaking) <= 2 * SLOTS, overtaking
    # The gpu queue: the flood's steps that started between the small run's step being sent and its start.
    sent, began = aware_utc(step.created_at), aware_utc(step.started_at)
    assert sum(1 for t in flood_steps if sent < aware_utc(t) <= began) <= 2
    # the dashboard's per-run queue waits (the "queue waits" chart) have the step's gpu wait
    assert abs(step.metrics["scheduling"]["gpu_queue_wait_s"] - (began - sent).total_seconds()) < 1e-3

    with session_scope() as s:  # the flood goes on unharmed by the small run: its episodes still roll out
        before = _count(flood, Episode.status == "completed")
    wait_for(lambda: _count(flood, Episode.status == "completed") > before, 60, interval=0.5,
             what=lambda: f"the flood to go on\n{logs()}")


def _rollouts(run_id: int) -> list[tuple]:
    """(started_at, rollout_finished_at or None) of each of the run's rollouts a worker claimed."""
    with session_scope() as s:
        rows = s.execute(select(Episode.started_at, Episode.rollout_finished_at)
                         .where(Episode.run_id == run_id, Episode.started_at.is_not(None))).all()
    return [(aware_utc(a), aware_utc(b) if b is not None else None) for a, b in rows]


def _in_flight(rollouts: list[tuple], t) -> int:
    """How many of `rollouts` a worker was running at instant `t`."""
    return sum(1 for a, b in rollouts if a <= t and (b is None or b > t))


def test_two_runs_share_the_rollout_workers_by_their_weights(postgres, redis_db, spawn, monkeypatch):
    """Two runs that each want 4 rollouts at once on workers that run 4 (`TURNSTILE_ROLLOUT_CAPACITY`)
    share them 3:1 by `scheduling.share` once both are under way (`app.control.shares`): the first
    run, alone at first, had all 4 and gives one back as its rollouts finish; from then on neither
    run ever has more in flight than its share, and both keep rolling out.

    Counted in events, not seconds: the window is the light run's next `light_rollouts` rollouts,
    however long a loaded box takes over them; the shares the scheduler grants are read at every
    poll, and the caps checked at every poll of the rows' states and at every rollout a worker
    started in the window (from the rows' own start and finish stamps).  How many rollouts the
    heavy run fits into its 3 slots depends on how fast its episodes are prepared (the box's
    speed), so only "not fewer than the light run's" is asserted of that count."""
    light_rollouts = 4
    monkeypatch.setenv("TURNSTILE_ROLLOUT_CAPACITY", "4")
    config.reset_settings()  # this process reads the capacity too (`shares.allowances`)
    workers = [spawn(celery_worker_args("control,prepare,grade", concurrency=2, name="cpu"), postgres, "cpu"),
               spawn(celery_worker_args("rollout", concurrency=4, name="rollout"), postgres, "rollout")]

    def logs() -> str:
        return "\n".join(f"--- {w.log_path.name}\n{w.output()[-2500:]}" for w in workers)

    def weighted(share: float) -> dict:
        cfg = _train(tasks=100, episode_s=0.8)  # 200 episodes each: neither runs out in the window
        cfg["scheduling"] = {**cfg["scheduling"], "share": share}
        return cfg

    heavy = _create(weighted(3.0))
    wait_for(lambda: _count(heavy, Episode.status == "running") == SLOTS, 120, interval=0.2,
             what=lambda: f"the first run to fill its slots alone\n{logs()}")
    light = _create(weighted(1.0))
    wait_for(lambda: _count(light, Episode.status == "running") >= 1, 120, interval=0.2,
             what=lambda: f"the second run's first rollout\n{logs()}")
    wait_for(lambda: _count(heavy, Episode.status == "running") <= 3, 60, interval=0.1,
             what=lambda: f"the first run to fall to its share\n{logs()}")
    # From here on the first run's dispatched rollouts never exceed 3: every later start is inside.
    shared_from = utcnow()
    samples, granted_shares = [], []

    def light_went_on() -> bool:  # a state poll each time: both runs' dispatched rollouts ("running")
        samples.append((_count(heavy, Episode.status == "running"), _count(light, Episode.status == "running")))
        with session_scope() as s:
            granted_shares.append(shares.allowances(s))
        return _count(light, Episode.started_at > shared_from,
                      Episode.rollout_finished_at.is_not(None)) >= light_rollouts

    # The timeout only guards against a hang; the assertions below count rollouts.
    wait_for(light_went_on, 300, interval=0.1, what=lambda: f"the second run's next rollouts\n{logs()}")
    assert all(g == {heavy: 3, light: 1} for g in granted_shares), granted_shares  # 4 slots split 3:1
    assert max(h for h, _ in samples) <= 3 and max(ln for _, ln in samples) <= 1, samples

    mine, theirs = _rollouts(heavy), _rollouts(light)
    starts = sorted(a for a, _ in mine + theirs if a > shared_from)
    window_end = sorted(a for a, _ in theirs if a > shared_from)[light_rollouts - 1]
    at_each_start = [(_in_flight(mine, t), _in_flight(theirs, t)) for t in starts]
    assert max(h for h, _ in at_each_start) <= 3 and max(ln for _, ln in at_each_start) <= 1, at_each_start
    granted = (sum(1 for a, _ in mine if shared_from < a <= window_end),
               sum(1 for a, _ in theirs if shared_from < a <= window_end))
    print(f"\nrollouts started while the runs shared the workers (heavy, light): {granted}; "
          f"in flight at each start: {at_each_start}")
    # Both kept rolling out, and the light run's one slot never let it outrun the heavy run's three.
    assert granted[1] == light_rollouts and granted[0] >= granted[1], granted
