"""Stage leases and the reaper on real SQL and Redis: an expired lease is re-dispatched, then the
episode failed after `max_redeliveries`; a flushed Redis is rebuilt from SQL; a SIGKILLed rollout
worker's episode is re-dispatched by the watchdog and finishes."""
from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import select

from app import config
from app.control import episodes, lease, reaper, runs, redis_state, watchdog
from app.db import session_scope
from app.tables import Episode, Run, utcnow
from support import REDIS_BASE, celery_worker_args, wait_for

REDIS_DB = 10


@pytest.fixture(autouse=True)
def var_dir(monkeypatch, tmp_path):
    """Run folders in the test's own folder."""
    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
    config.reset_settings()
    yield tmp_path / "var"
    config.reset_settings()


@pytest.fixture
def short_leases(monkeypatch, var_dir):
    """Leases of 2 s renewed every 0.5 s, one redelivery allowed."""
    monkeypatch.setenv("TURNSTILE_LEASE_TTL_S", "2")
    monkeypatch.setenv("TURNSTILE_LEASE_RENEW_S", "0.5")
    monkeypatch.setenv("TURNSTILE_MAX_REDELIVERIES", "1")
    config.reset_settings()
    yield
    config.reset_settings()


def _started_run(rollout_slots: int = 1, group_size: int = 4, median_s: float = 0.0) -> tuple[int, list[int]]:
    """A simulated eval run started in-process; returns (run id, episode ids sent to prepare)."""
    with session_scope() as s:
        run = Run(kind="eval", status="queued", config={
            "kind": "eval", "group_size": group_size, "tasks_per_step": 1,
            "simulate": {"episode_median_s": median_s},
            "scheduling": {"rollout_slots": rollout_slots, "ready_depth": 2}})
        s.add(run)
        s.flush()
        run_id = run.id
    plan = runs.start_run(run_id)
    redis_state.set_marker()  # Redis holds its state (no loss to rebuild from)
    return run_id, plan.prepare


def _episode(episode_id: int) -> Episode:
    with session_scope() as s:
        return s.get(Episode, episode_id)


def _expire(episode_id: int) -> None:
    with session_scope() as s:
        s.get(Episode, episode_id).lease_expires_at = utcnow() - dt.timedelta(seconds=1)


def test_an_expired_lease_is_redispatched_once_then_the_episode_fails(any_database, redis_db, short_leases):
    run_id, prepare = _started_run()
    episode_id = prepare[0]
    assert _episode(episode_id).lease_owner is None  # dispatched: waiting for a worker
    with session_scope() as s:  # a worker takes the stage ...
        assert lease.claim(s, episode_id, "preparing", "dead-worker:1:a")
    with session_scope() as s:  # ... so a duplicate message finds a live lease and does nothing
        assert not lease.claim(s, episode_id, "preparing", "other:2:b")
    # the worker dies: its lease runs out
    _expire(episode_id)
    plans, report = watchdog.recover_episodes(set())
    assert report["leases"]["redispatched"] == [[episode_id, "preparing"]]
    assert [p.prepare for p in plans if p.prepare] == [[episode_id]]
    ep = _episode(episode_id)
    assert (ep.status, ep.lease_owner, ep.redeliveries) == ("preparing", None, 1)
    # the re-sent message is claimed, and that worker dies too
    with session_scope() as s:
        assert lease.claim(s, episode_id, "preparing", "dead-again:3:c")
    _expire(episode_id)
    plans, report = watchdog.recover_episodes(set())
    assert report["leases"]["failed"] == [episode_id] and any(run_id in p.tick for p in plans)
    ep = _episode(episode_id)
    assert ep.status == "failed" and "lease expired after 1 re-dispatches" in ep.error
    assert "dead-again:3:c" in ep.error


def test_a_message_still_on_its_queue_is_waited_for_and_a_lost_one_resent(database, redis_db, short_leases):
    run_id, prepare = _started_run()
    waiting, lost = prepare[0], prepare[1]
    for episode_id in (waiting, lost):
        _expire(episode_id)
    plans, report = watchdog.recover_episodes({("preparing", waiting)})
    assert report["leases"]["waiting"] == [waiting]
    assert report["leases"]["redispatched"] == [[lost, "preparing"]]
    assert _episode(waiting).redeliveries == 0 and _episode(waiting).lease_expires_at is not None
    assert _episode(lost).redeliveries == 1
    # the re-sent prepare runs and the episode goes on as usual
    episodes.prepare(lost)
    assert _episode(lost).status in ("ready", "running")


def test_a_flushed_redis_is_rebuilt_to_what_sql_implies(database, redis_db):
    run_id, prepare = _started_run(rollout_slots=1, group_size=4)
    for episode_id in prepare:  # prepared in-process: one rolls out, the others wait in READY
        episodes.prepare(episode_id)
    with session_scope() as s:
        eps = {e.id: e for e in s.scalars(select(Episode).where(Episode.run_id == run_id))}
        unclaimed = [e.id for e in eps.values() if e.status == "preparing"]  # dispatched by the last tick
        # a straggler cut: cancelled while its rollout may still run somewhere
        cancelled = next(e.id for e in eps.values() if e.status == "ready")
        s.get(Episode, cancelled).status = "cancelled"
        s.get(Episode, cancelled).finished_at = utcnow()
    redis_state.flag_cancelled(cancelled)
    redis_state.set_ready(run_id, [e for e in redis_state.ready_ids(run_id) if e != cancelled])
    watchdog.recover_episodes(set())  # a pass on a healthy Redis sets the marker, changes nothing
    before = {"ready": redis_state.ready_ids(run_id), "cancel": redis_state.is_cancelled(cancelled)}
    want = reaper.expected_redis_state(run_id)
    assert before["ready"] == want["ready"] and len(want["ready"]) >= 1 and before["cancel"]

    redis_db.flushdb()  # Redis restarted without its data: queues, READY buffer, flags, marker gone
    plans, report = watchdog.recover_episodes(set())
    assert report["redis"]["lost"] is True and run_id in report["redis"]["ready"]
    assert redis_state.ready_ids(run_id) == want["ready"]
    assert redis_state.slots_free(run_id) == want["free_slots"] == 0  # the one slot is held by a running episode
    assert redis_state.is_cancelled(cancelled) and redis_state.has_marker()
    # the stages no worker had claimed lost their messages with the queues: sent again, not counted
    assert sorted(e for e, _ in report["redis"]["resent"]) == sorted(
        unclaimed + [e for e in want["running"] if _episode(e).lease_owner is None])
    assert all(_episode(e).redeliveries == 0 for e in unclaimed)
    # a tick that crashed between popping READY and starting the rollout: the mismatch is repaired
    redis_state.pop_ready(run_id)
    _, report = watchdog.recover_episodes(set())
    assert report["redis"]["lost"] is False and report["redis"]["ready"] == [run_id]
    assert redis_state.ready_ids(run_id) == want["ready"]


def test_a_tick_that_meets_the_reapers_lock_is_sent_again(database, redis_db, monkeypatch):
    """The reaper holds the run's tick lock while it compares Redis with SQL; a tick arriving then
    returns at once and leaves the dirty mark for the holder.  The reaper must hand that on, or
    the run waits for the next watchdog pass (with no beat, forever: a run that never finished)."""
    from app.control import scheduler

    run_id, _ = _started_run(rollout_slots=1, group_size=2)
    expected = reaper.expected_redis_state
    lost_ticks = []

    def tick_during_the_pass(rid):
        lost_ticks.append(scheduler.tick(rid))  # another process's tick, e.g. a graded episode's
        return expected(rid)

    monkeypatch.setattr(reaper, "expected_redis_state", tick_during_the_pass)
    plans, _ = watchdog.recover_episodes(set())
    assert len(lost_ticks) == 1 and not lost_ticks[0]  # it found the lock held: it planned nothing
    assert redis_state.is_dirty(run_id)  # and left its mark (a tick that ran takes it)
    assert any(run_id in plan.tick for plan in plans), plans
    # with no tick arriving, a pass sends none
    monkeypatch.setattr(reaper, "expected_redis_state", expected)
    redis_state.take_dirty(run_id)
    plans, _ = watchdog.recover_episodes(set())
    assert not any(run_id in plan.tick for plan in plans)


def test_a_sigkilled_rollout_worker_is_reaped_and_the_run_finishes(database, redis_db, spawn, monkeypatch,
                                                                     var_dir):
    """Fault injection: SIGKILL of the whole rollout worker (main process and children) mid-episode.
    Celery would redeliver the unacked message only after the visibility timeout (hours); the
    episode's lease expires after 2 s and the watchdog re-dispatches it to a new worker."""
    from app.tasks import control as control_tasks
    from support import api_client
    from app import create_app

    env = {"DATABASE_URL": database, "REDIS_URL": f"{REDIS_BASE}/10", "TURNSTILE_VAR_DIR": str(var_dir),
           "TURNSTILE_LEASE_TTL_S": "2", "TURNSTILE_LEASE_RENEW_S": "0.5"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config.reset_settings()
    cpu = spawn(celery_worker_args("control,prepare,grade", concurrency=2, name="cpu"), env, "cpu")
    rollout = spawn(celery_worker_args("rollout", concurrency=1, name="rollout"), env, "rollout")
    resp = api_client(create_app()).post("/api/runs", json={
        "kind": "eval", "group_size": 1, "tasks_per_step": 1, "simulate": {"episode_median_s": 2.5}})
    assert resp.status_code == 202, resp.get_json()
    run_id = resp.get_json()["id"]

    def running():
        with session_scope() as s:
            return s.scalar(select(Episode.id).where(Episode.run_id == run_id, Episode.status == "running",
                                                     Episode.lease_owner.is_not(None)))

    episode_id = wait_for(running, 30, what=f"the rollout to start\n{rollout.output()[-2000:]}")
    rollout.kill()  # SIGKILL to the worker's process group
    second = spawn(celery_worker_args("rollout", concurrency=1, name="rollout2"), env, "rollout2")
    passes = []

    def redispatched():
        passes.append(control_tasks.watchdog())  # what beat runs every watchdog_interval_s
        return passes[-1]["episodes"]["leases"]["redispatched"]

    assert wait_for(redispatched, 20, interval=0.5, what="the reaper") == [[episode_id, "running"]], passes

    def finished():
        with session_scope() as s:
            return s.get(Run, run_id).status in ("completed", "failed")

    wait_for(finished, 30, what=f"the run to finish\n{second.output()[-2000:]}")
    ep = _episode(episode_id)
    with session_scope() as s:
        assert s.get(Run, run_id).status == "completed"
        assert len(s.scalars(select(Episode.id).where(Episode.run_id == run_id)).all()) == 1  # none duplicated
    # redelivered by the watchdog's pass above (Celery's own redelivery would come hours later)
    assert (ep.status, ep.attempts, ep.redeliveries) == ("completed", 2, 1)
    for proc in (cpu, second):
        proc.kill()  # SIGKILL: no warm shutdown to wait for


def test_a_redispatched_rollout_starts_from_a_fresh_runtime(database, redis_db, short_leases):
    """The lost attempt's agent may have edited its workspace: attempt 2 gets a newly prepared one."""
    run_id, prepare = _started_run(rollout_slots=1, group_size=1)
    episodes.prepare(prepare[0])  # READY, then running (the slot is free)
    episode_id = prepare[0]
    with session_scope() as s:  # attempt 1 claimed by a worker that then dies mid-rollout
        ep = s.get(Episode, episode_id)
        assert ep.status == "running"
        assert lease.claim(s, episode_id, "running", "dead:1:a", attempts=1)
        ep.runtime = {"simulated": True, "edited_by_attempt": 1}
    _expire(episode_id)
    plans, report = watchdog.recover_episodes(set())
    assert report["leases"]["redispatched"] == [[episode_id, "running"]]
    episodes.rollout(episode_id)  # the re-sent message, in-process
    ep = _episode(episode_id)
    assert ep.attempts == 2 and ep.status == "grading"
    assert ep.runtime == {"simulated": True, "host": config.get_settings().host_name}  # prepared again, here
