"""Scheduler rules on real SQL + Redis: staleness bound, early stopping, group rejection,
completion-order training, and priority of eval runs on shared queues."""
from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import select, update

from app.control import scheduler, redis_state
from app.db import session_scope
from app.tables import Episode, Group, Run, TaskInstance, TrainingStep
from app.runconfig import RunConfig
from support import REDIS_BASE, api_client, celery_worker_args, wait_for

REDIS_DB = 10


@pytest.fixture(autouse=True)
def _fresh_redis(redis_db):
    yield


def _train_run(s, **scheduling) -> Run:
    cfg = RunConfig.model_validate({"kind": "train", "group_size": 4, "tasks_per_step": 1, "steps": 5,
                                    "simulate": {}, "scheduling": scheduling})
    inst = TaskInstance(task_set="simulated", instance_id="sim-0", repo="simulated", record={})
    run = Run(kind="train", config=cfg.model_dump(mode="json"), status="running")
    s.add_all([inst, run])
    s.flush()
    run.summary = {"instance_ids": [inst.id]}
    return run


def _group(s, run: Run, index: int, statuses: list[str], started_version: int = 0, completed_at=None) -> Group:
    g = Group(run_id=run.id, group_index=index, instance_id=run.summary["instance_ids"][0],
              policy_version=started_version, completed_at=completed_at)
    s.add(g)
    for k, status in enumerate(statuses):
        s.add(Episode(run_id=run.id, instance_id=g.instance_id, group_index=index, sample_index=k, status=status,
                      policy_version=started_version, reward=1.0 if status == "completed" and k % 2 else
                      (0.0 if status == "completed" else None)))
    s.flush()
    return g


def _cfg(run: Run) -> RunConfig:
    return RunConfig.model_validate(run.config)


def test_stale_group_is_dropped(database):
    with session_scope() as s:
        run = _train_run(s, max_staleness=2)
        run.policy_version = 3
        fresh = _group(s, run, 0, ["completed"] * 4, started_version=1)
        stale = _group(s, run, 1, ["completed"] * 4, started_version=0)
        scheduler._close_complete_groups(s, run, _cfg(run))
        assert fresh.status == "accepted"
        assert stale.status == "dropped" and "served by version 0, policy is 3" in stale.reason


def test_staleness_is_judged_by_the_versions_that_served_the_completions(database):
    """Episodes started at version 1 but their engine still served version 0 (its weight sync had
    failed): with max_staleness 0 the group is stale, not fresh."""
    from app.tables import Completion

    with session_scope() as s:
        run = _train_run(s, max_staleness=0)
        run.policy_version = 1
        g = _group(s, run, 0, ["completed"] * 4, started_version=1)
        for ep in s.scalars(select(Episode).where(Episode.run_id == run.id)):
            s.add(Completion(episode_id=ep.id, seq=0, request_key=f"k{ep.id}", api="chat", raw_request={},
                             prompt_ids=[1, 2], sampled_ids=[3], logprobs=[-0.1], policy_version=0))
        s.flush()
        scheduler._close_complete_groups(s, run, _cfg(run))
        assert g.status == "dropped" and "served by version 0, policy is 1" in g.reason


def test_stale_group_can_be_downweighted(database):
    with session_scope() as s:
        run = _train_run(s, max_staleness=1, stale_policy="downweight")
        run.policy_version = 3
        g = _group(s, run, 0, ["completed"] * 4, started_version=0)
        scheduler._close_complete_groups(s, run, _cfg(run))
        assert g.status == "accepted" and g.weight == pytest.approx(1 / 3)


def test_staleness_is_checked_again_when_a_step_consumes_groups(database):
    with session_scope() as s:
        run = _train_run(s, max_staleness=1)
        g = _group(s, run, 0, ["completed"] * 4, started_version=0)
        scheduler._close_complete_groups(s, run, _cfg(run))
        assert g.status == "accepted"
        run.policy_version = 2  # two updates happened before a step could take the group
        assert scheduler._maybe_create_step(s, run, _cfg(run)) is None
        assert g.status == "dropped"


def test_stragglers_are_cancelled_once_enough_episodes_are_graded(database, redis_db):
    with session_scope() as s:
        run = _train_run(s, min_usable=3, cancel_stragglers=True)
        g = _group(s, run, 0, ["completed", "completed", "completed", "running"])
        # its harness holds a live gateway key
        s.execute(update(Episode).where(Episode.status == "running").values(session_token_hash="0" * 64))
        scheduler._close_complete_groups(s, run, _cfg(run))
        eps = s.scalars(select(Episode).where(Episode.group_index == 0).order_by(Episode.sample_index)).all()
        assert eps[3].status == "cancelled" and "straggler" in eps[3].error
        assert eps[3].session_token_hash is None  # the gateway refuses the cancelled episode's key at once
        assert redis_db.exists(redis_state.cancel_key(eps[3].id))  # the rollout sees the flag and stops
        assert g.status == "accepted"


def test_stragglers_run_on_without_early_stopping(database):
    with session_scope() as s:
        run = _train_run(s, min_usable=3, cancel_stragglers=False)
        g = _group(s, run, 0, ["completed", "completed", "completed", "running"])
        scheduler._close_complete_groups(s, run, _cfg(run))
        assert g.status == "open"


def test_group_with_too_few_usable_episodes_is_rejected(database):
    with session_scope() as s:
        run = _train_run(s, min_accept_fraction=0.5)
        g = _group(s, run, 0, ["completed", "failed", "failed", "cancelled"])
        ok = _group(s, run, 1, ["completed", "completed", "failed", "failed"])
        scheduler._close_complete_groups(s, run, _cfg(run))
        assert g.status == "rejected" and g.reason == "1/4 usable episodes"
        assert ok.status == "accepted"


def test_steps_take_groups_in_completion_order(database):
    now = dt.datetime.now(dt.timezone.utc)
    with session_scope() as s:
        run = _train_run(s)
        late = _group(s, run, 0, ["completed"] * 4, completed_at=now)
        early = _group(s, run, 1, ["completed"] * 4, completed_at=now - dt.timedelta(seconds=5))
        late.status = early.status = "accepted"
        step = scheduler._maybe_create_step(s, run, _cfg(run))
        assert step == 0 and early.status == "trained" and late.status == "accepted"
        row = s.scalars(select(TrainingStep).where(TrainingStep.run_id == run.id)).one()
        assert set(row.episode_ids) == set(s.scalars(select(Episode.id).where(Episode.group_index == 1)))


def test_eval_run_jumps_the_rollout_queue(database, spawn):
    """A train run fills one rollout process; an eval run created later starts before the train's backlog."""
    from app import create_app

    env = {"DATABASE_URL": database, "REDIS_URL": f"{REDIS_BASE}/10"}
    client = api_client(create_app())
    cpu = spawn(celery_worker_args("control,prepare,grade,gpu", concurrency=2, name="cpu"), env, "cpu")
    train = client.post("/api/runs", json={"kind": "train", "group_size": 6, "tasks_per_step": 1, "steps": 1,
                                           "simulate": {"episode_median_s": 0.5},
                                           "scheduling": {"rollout_slots": 6, "ready_depth": 0}}).get_json()["id"]

    def queued_rollouts():
        with session_scope() as s:
            return s.scalar(select(Episode.id).where(Episode.run_id == train, Episode.status == "running")
                            .offset(5).limit(1))

    wait_for(queued_rollouts, 60, what=f"6 train rollouts queued\n{cpu.output()[-2000:]}")
    evaluation = client.post("/api/runs", json={"kind": "eval", "group_size": 2, "simulate": {"episode_median_s": 0.5},
                                                "scheduling": {"rollout_slots": 2, "ready_depth": 0}}).get_json()["id"]

    def eval_queued():
        with session_scope() as s:
            return s.scalar(select(Episode.id).where(Episode.run_id == evaluation, Episode.status == "running")
                            .offset(1).limit(1))

    wait_for(eval_queued, 60, what="eval rollouts queued")
    rollout = spawn(celery_worker_args("rollout", concurrency=1, name="rollout"), env, "rollout")
    wait_for(lambda: client.get(f"/api/runs/{evaluation}").get_json()["status"] == "completed", 90,
             what=f"eval run to finish\n{rollout.output()[-2000:]}")
    with session_scope() as s:
        eval_start = max(s.scalars(select(Episode.started_at).where(Episode.run_id == evaluation)))
        train_starts = sorted(s.scalars(select(Episode.started_at).where(Episode.run_id == train,
                                                                          Episode.started_at.is_not(None))))
    # With one rollout process, at most the train message already reserved ran before the eval ones.
    assert sum(1 for t in train_starts if t < eval_start) <= 1, (eval_start, train_starts)


def test_a_fresh_database_does_not_inherit_redis_state_of_reused_ids(database, redis_db):
    """Row ids restart with a new SQL database while Redis keeps its keys: an earlier database's
    cancel flags and READY/slot keys under the same ids must not reach the new run's episodes."""
    from app.control import runs

    for episode_id in range(1, 9):  # left by an earlier database's cancelled episodes
        redis_db.set(redis_state.cancel_key(episode_id), 1)
    with session_scope() as s:
        cfg = RunConfig.model_validate({"kind": "eval", "group_size": 2, "simulate": {"episode_median_s": 0.1}})
        run = Run(kind="eval", config=cfg.model_dump(mode="json"), status="queued")
        s.add(run)
        s.flush()
        run_id = run.id
    redis_db.rpush(redis_state.ready_key(run_id), 99, 98)
    redis_db.rpush(redis_state.slot_free_key(run_id), *["x"] * 50)
    runs.start_run(run_id)
    with session_scope() as s:
        ids = list(s.scalars(select(Episode.id).where(Episode.run_id == run_id)))
    assert ids and not any(redis_state.is_cancelled(e) for e in ids)
    assert not {99, 98} & set(redis_state.ready_ids(run_id))
    assert redis_state.slots_free(run_id) < 50


def _uniform(s, run: Run, index: int, reward: float) -> Group:
    g = _group(s, run, index, ["completed"] * 4)
    s.execute(update(Episode).where(Episode.run_id == run.id, Episode.group_index == index).values(reward=reward))
    s.flush()
    return g


def test_dynamic_sampling_sets_uniform_groups_aside_draws_others_and_trains_only_mixed_ones(database):
    from app.control.summary import summarize_run

    with session_scope() as s:
        run = _train_run(s, dynamic_sampling=True, max_filtered_groups=5, max_async_level=0)
        none_solved, all_solved = _uniform(s, run, 0, 0.0), _uniform(s, run, 1, 1.0)
        scheduler._close_complete_groups(s, run, _cfg(run))
        assert (none_solved.status, none_solved.step) == ("filtered", 0) and "all 4 usable rewards are 0" in none_solved.reason
        assert (all_solved.status, all_solved.step) == ("filtered", 0)
        assert scheduler._maybe_create_step(s, run, _cfg(run)) is None  # nothing trainable yet
        scheduler._plan_train(s, run, _cfg(run))  # filtered groups do not count as live: a new one is drawn
        assert s.scalar(select(Group.group_index).where(Group.run_id == run.id, Group.status == "open")) == 2
        drawn = s.scalars(select(Episode).where(Episode.run_id == run.id, Episode.group_index == 2)).all()
        for e in drawn:  # the drawn group's rollouts finish with rewards 0, 1, 0, 1
            e.status, e.reward = "completed", float(e.sample_index % 2)
        mixed = s.scalars(select(Group).where(Group.run_id == run.id, Group.group_index == 2)).one()
        scheduler._close_complete_groups(s, run, _cfg(run))
        assert mixed.status == "accepted"
        assert scheduler._maybe_create_step(s, run, _cfg(run)) == 0 and mixed.status == "trained"
        row = s.scalars(select(TrainingStep).where(TrainingStep.run_id == run.id)).one()
        assert set(row.episode_ids) == {e.id for e in drawn}
        summary = summarize_run(s, run.id)
        first = summary["steps"][0]
        assert first["reward_mean"] == 0.5 and first["groups_filtered"] == 2
        assert first["sampled_reward_mean"] == pytest.approx((0 + 4 + 2) / 12)  # drawn: 0000, 1111, 0101


def test_dynamic_sampling_trains_uniform_groups_once_the_step_cap_is_reached(database):
    with session_scope() as s:
        run = _train_run(s, dynamic_sampling=True, max_filtered_groups=1)
        first, second = _uniform(s, run, 0, 0.0), _uniform(s, run, 1, 0.0)
        scheduler._close_complete_groups(s, run, _cfg(run))
        assert first.status == "filtered" and second.status == "accepted"


def test_without_dynamic_sampling_uniform_groups_are_trained(database):
    with session_scope() as s:
        run = _train_run(s)
        g = _uniform(s, run, 0, 0.0)
        scheduler._close_complete_groups(s, run, _cfg(run))
        assert g.status == "accepted"


def test_a_uniform_group_accepted_past_one_steps_cap_is_set_aside_for_the_next_step_not_trained(database):
    """Seen in a real run: step 1's cap was reached, so `1111` and `0000` groups were accepted while
    step 1 was being formed from earlier mixed groups; they must not become step 2's groups."""
    now = dt.datetime.now(dt.timezone.utc)
    with session_scope() as s:
        run = _train_run(s, dynamic_sampling=True, max_filtered_groups=1)
        first = _uniform(s, run, 0, 0.0)
        scheduler._close_complete_groups(s, run, _cfg(run))
        late_uniform = _uniform(s, run, 1, 1.0)
        mixed = _group(s, run, 2, ["completed"] * 4)
        scheduler._close_complete_groups(s, run, _cfg(run))
        late_uniform.completed_at, mixed.completed_at = now - dt.timedelta(seconds=5), now
        assert first.status == "filtered" and late_uniform.status == "accepted"  # step 0's cap of 1 is reached
        assert scheduler._maybe_create_step(s, run, _cfg(run)) == 0
        assert mixed.status == "trained"  # signal first, although the uniform group completed earlier
        s.scalars(select(TrainingStep).where(TrainingStep.run_id == run.id)).one().status = "completed"
        another = _group(s, run, 3, ["completed"] * 4)
        scheduler._close_complete_groups(s, run, _cfg(run))
        assert scheduler._maybe_create_step(s, run, _cfg(run)) == 1
        assert (late_uniform.status, late_uniform.step) == ("filtered", 1) and another.status == "trained"
