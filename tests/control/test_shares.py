"""Weighted fair shares of the rollout workers (`app.control.shares`): the water-filling itself, and
each run's allowance read from real SQL (SQLite and PostgreSQL) with runs and episodes in every
state a deployment holds (running, a run not started yet, one cancelling, one finished)."""
from __future__ import annotations

import pytest

from app import config
from app.control.shares import allowance, allowances, water_fill
from app.db import session_scope
from app.tables import Episode, Run, TaskInstance


def test_equal_weights_split_evenly_and_the_remainder_goes_to_the_older_runs():
    assert water_fill(8, {1: 100, 2: 100}, {}) == {1: 4, 2: 4}
    assert water_fill(5, {1: 100, 2: 100, 3: 100}, {}) == {1: 2, 2: 2, 3: 1}


def test_weights_set_the_split():
    assert water_fill(8, {1: 100, 2: 100}, {1: 3.0, 2: 1.0}) == {1: 6, 2: 2}
    assert water_fill(10, {1: 100, 2: 100, 3: 100}, {1: 2.0, 2: 2.0, 3: 1.0}) == {1: 4, 2: 4, 3: 2}


def test_a_run_that_wants_less_than_its_share_leaves_the_rest_to_the_others():
    assert water_fill(8, {1: 100, 2: 1}, {}) == {1: 7, 2: 1}
    # run 3 is sated at 2 of its weighted 4; runs 1 and 2 split the other 8 by weight (1:2): 2.67
    # and 5.33, the spare slot to the larger remainder
    assert water_fill(10, {1: 100, 2: 100, 3: 2}, {1: 1.0, 2: 2.0, 3: 2.0}) == {1: 3, 2: 5, 3: 2}
    assert water_fill(8, {1: 3, 2: 2}, {}) == {1: 3, 2: 2}  # room for all: each its demand
    assert water_fill(8, {1: 0, 2: 100}, {}) == {1: 0, 2: 8}


def test_every_run_that_wants_rollouts_gets_one_slot_even_past_the_capacity():
    out = water_fill(2, {1: 10, 2: 10, 3: 10, 4: 10}, {1: 100.0})
    assert out[1] >= 1 and all(v == 1 for k, v in out.items() if k != 1)


def _train(slots: int, share: float | None = None) -> dict:
    sched = {"rollout_slots": slots, **({"share": share} if share is not None else {})}
    return {"kind": "train", "group_size": 2, "tasks_per_step": 1, "scheduling": sched,
            "simulate": {"episode_median_s": 0.1}}


def _seed(s, status: str, cfg: dict, episodes: dict[str, int]) -> int:
    run = Run(kind=cfg["kind"], status=status, config=cfg)
    s.add(run)
    s.flush()
    inst = TaskInstance(task_set="shares", instance_id=f"i{run.id}", repo="r", record={})
    s.add(inst)
    s.flush()
    k = 0
    for ep_status, n in episodes.items():
        for _ in range(n):
            s.add(Episode(run_id=run.id, instance_id=inst.id, group_index=k, sample_index=0, status=ep_status))
            k += 1
    return run.id


@pytest.fixture
def capacity_8(any_database, monkeypatch):
    monkeypatch.setenv("TURNSTILE_ROLLOUT_CAPACITY", "8")
    config.reset_settings()
    yield
    config.reset_settings()


def test_allowance_shares_the_capacity_among_running_runs_only(capacity_8):
    with session_scope() as s:
        a = _seed(s, "running", _train(8, share=3.0), {"queued": 10, "ready": 2, "running": 4, "completed": 5})
        b = _seed(s, "running", _train(8), {"queued": 10, "preparing": 1, "running": 4})
        # none of these want the rollout workers now
        _seed(s, "queued", _train(8), {})                              # a run that never started
        _seed(s, "cancelling", _train(8), {"running": 3, "queued": 20})
        _seed(s, "completed", _train(8), {"completed": 6})
        alone = _seed(s, "running", _train(2), {"completed": 4})      # running, nothing left to roll out
    with session_scope() as s:
        assert (allowance(s, a), allowance(s, b)) == (6, 2)
        assert allowance(s, alone) == 1  # asked from its own tick: it may be about to draw groups
        assert allowances(s) == {a: 6, b: 2, alone: 0}  # as they stand, for the dashboard


def test_a_run_alone_keeps_its_slots_and_a_run_near_its_end_frees_the_rest(capacity_8):
    with session_scope() as s:
        a = _seed(s, "running", _train(8), {"queued": 10, "running": 4})
    with session_scope() as s:
        assert allowance(s, a) is None  # nobody else wants the rollout workers: rollout_slots holds
        assert allowances(s) == {a: None}
    with session_scope() as s:
        b = _seed(s, "running", _train(8), {"running": 1})  # one episode left
    with session_scope() as s:
        assert (allowance(s, a), allowance(s, b)) == (7, 1)
        s.get(Run, b).status = "completed"
    with session_scope() as s:
        assert allowance(s, a) is None
