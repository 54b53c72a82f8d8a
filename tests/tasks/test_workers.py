"""Real `celery -A app worker` subprocesses on the real Redis: runs complete, SIGKILL loses nothing.

Runs here use the simulated stages (`simulate` in the run config): the episode
stages sleep instead of running a harness, so the test exercises exactly the
scheduling, queues, acknowledgement and compare-and-set paths.
"""
from __future__ import annotations

import time

import pytest
from sqlalchemy import func, select

from app import create_app
from app.db import session_scope
from app.tables import Episode, Group, Run, TrainingStep
from support import REDIS_BASE, api_client, celery_worker_args, wait_for

REDIS_DB = 10
QUEUES = "control,prepare,rollout,grade,gpu"


@pytest.fixture
def env(database, redis_db):
    return {"DATABASE_URL": database, "REDIS_URL": f"{REDIS_BASE}/10",
            "TURNSTILE_VISIBILITY_TIMEOUT": "6", "TURNSTILE_LEASE_TTL_S": "3"}


def _create(config: dict) -> int:
    client = api_client(create_app())
    resp = client.post("/api/runs", json=config)
    assert resp.status_code == 202, resp.get_json()
    return resp.get_json()["id"]


def _run_status(run_id: int) -> str:
    with session_scope() as s:
        return s.get(Run, run_id).status


def test_run_completes_through_real_worker(env, spawn):
    worker = spawn(celery_worker_args(QUEUES, concurrency=4), env, name="worker")
    run_id = _create({"kind": "train", "group_size": 2, "tasks_per_step": 2, "steps": 2, "mode": "sync",
                      "simulate": {"episode_median_s": 0.2, "train_s": 0.2, "reward_p": 0.5}})
    wait_for(lambda: _run_status(run_id) in ("completed", "failed"), 90, what=f"run {run_id} to finish\n{worker.output()[-3000:]}")
    assert _run_status(run_id) == "completed", worker.output()[-3000:]
    with session_scope() as s:
        run = s.get(Run, run_id)
        steps = s.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id).order_by(TrainingStep.step)).all()
        assert [st.status for st in steps] == ["completed", "completed"]
        assert [st.policy_version for st in steps] == [1, 2] and run.policy_version == 2
        # sync mode: the second step's episodes started under the policy of the first update
        for st, version in zip(steps, (0, 1)):
            versions = set(s.scalars(select(Episode.policy_version).where(Episode.id.in_(st.episode_ids))))
            assert versions == {version}
            assert len(st.episode_ids) == 4
        assert run.summary["steps"][1]["episodes"] == 4
        assert run.summary["episodes_by_status"] == {"completed": 8}


def test_worker_sigkill_mid_episode_loses_nothing(env, spawn):
    from app.control import watchdog as control_watchdog
    from app.tasks.send import send

    first = spawn(celery_worker_args(QUEUES, concurrency=4), env, name="first")
    run_id = _create({"kind": "eval", "group_size": 2, "tasks_per_step": 1, "steps": 1,
                      "simulate": {"episode_median_s": 4.0},
                      "scheduling": {"rollout_slots": 2}})

    def running_now():
        with session_scope() as s:
            return s.scalars(select(Episode.id).where(Episode.run_id == run_id, Episode.status == "running",
                                                      Episode.attempts == 1)).all()

    killed = wait_for(running_now, 60, what="an episode to be mid-rollout")
    time.sleep(0.5)
    first.kill()  # SIGKILL to the whole worker: main process and its pool children
    second = spawn(celery_worker_args(QUEUES, concurrency=4), env, name="second")

    def finished():
        # Beat's pass over episodes (the reaper): a lease that expired with the killed worker is
        # re-dispatched, whether or not Redis has restored the unacked message to the new worker yet.
        plans, _ = control_watchdog.recover_episodes(None)
        for plan in plans:
            send(plan)
        return _run_status(run_id) in ("completed", "failed")

    wait_for(finished, 120, interval=1.0, what=f"run to finish after the kill\n{second.output()[-3000:]}")
    assert _run_status(run_id) == "completed", second.output()[-3000:]
    with session_scope() as s:
        eps = s.scalars(select(Episode).where(Episode.run_id == run_id)).all()
        assert len(eps) == 2  # no duplicated episode rows
        assert {e.status for e in eps} == {"completed"}
        by_id = {e.id: e for e in eps}
        for episode_id in killed:
            assert by_id[episode_id].attempts == 2, "the killed attempt was redelivered and re-claimed once"
        assert s.scalar(select(func.count()).select_from(Group).where(Group.run_id == run_id)) == 1


def _gpu_and_cpu_workers(spawn, env):
    """A gpu worker of one pool child and a worker for the other queues; returns the gpu worker."""
    gpu = spawn(celery_worker_args("gpu", concurrency=1, name="gpu"), env, name="gpu")
    spawn(celery_worker_args("control,prepare,rollout,grade", concurrency=3, name="cpu"), env, name="cpu")
    return gpu


def _wait_training(run_id: int, gpu) -> None:
    def training():
        with session_scope() as s:
            return s.scalar(select(TrainingStep.id).where(TrainingStep.run_id == run_id,
                                                          TrainingStep.status == "training"))

    wait_for(training, 60, what=lambda: f"run {run_id}'s step to start training\n{gpu.output()[-3000:]}")


def _kill_pool_child(gpu) -> None:
    """SIGKILL the gpu worker's one prefork pool child (the process running the step)."""
    import os
    import signal

    children = [int(p) for p in open(f"/proc/{gpu.popen.pid}/task/{gpu.popen.pid}/children").read().split()]
    assert len(children) == 1, children  # prefork pool, concurrency 1
    os.kill(children[0], signal.SIGKILL)


def _watchdog_until_resent(monkeypatch, what: str) -> tuple[list, list]:
    """What beat runs every 30 s, here in-process and more often, until a pass re-sends a step: a
    worker may still list the lost task as active for a moment after its child died, so a pass may
    find nothing yet.  Returns (that pass's re-sent steps, every pass's report)."""
    from app.control import watchdog as control_watchdog
    from app.tasks import control as control_tasks

    monkeypatch.setattr(control_watchdog, "STEP_GRACE_S", 0.0)  # the step is old enough to be orphaned
    passes = []

    def resent():
        passes.append(control_tasks.watchdog())
        return passes[-1]["resent"]

    return wait_for(resent, 60, interval=2, what=what), passes


def test_killed_gpu_pool_child_leaves_the_step_to_the_watchdog(env, spawn, monkeypatch):
    """SIGKILL of the gpu worker's pool child mid-step: the step is not failed (Celery reports a
    WorkerLostError to the errback); the watchdog re-sends it and the run completes."""
    gpu = _gpu_and_cpu_workers(spawn, env)
    run_id = _create({"kind": "train", "group_size": 2, "tasks_per_step": 1, "steps": 1,
                      "simulate": {"episode_median_s": 0.1, "train_s": 6.0}})
    _wait_training(run_id, gpu)
    _kill_pool_child(gpu)
    time.sleep(3)  # the errback has long run by now
    with session_scope() as s:
        step = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id))
        assert step.status == "training" and step.error is None, (step.status, step.error)
        assert s.get(Run, run_id).status == "running"
    resent, passes = _watchdog_until_resent(monkeypatch, "the watchdog to re-send the step")
    assert resent == [(run_id, 0)], passes
    wait_for(lambda: _run_status(run_id) in ("completed", "failed"), 60,
             what=lambda: f"the run to finish after the re-send\n{gpu.output()[-3000:]}")
    assert _run_status(run_id) == "completed", gpu.output()[-3000:]
    with session_scope() as s:
        assert s.get(Run, run_id).policy_version == 1


def test_a_killed_step_of_one_run_is_re_sent_while_another_runs_steps_go_on(env, spawn, monkeypatch):
    """Two train runs on one gpu worker: SIGKILL of the pool child in run A's step loses A's step
    only; run B's steps (queued behind it, then after it) train and complete before the watchdog
    re-sends A's, which then completes too; each run's policy version counts its own steps once."""
    gpu = _gpu_and_cpu_workers(spawn, env)
    a = _create({"kind": "train", "group_size": 2, "tasks_per_step": 1, "steps": 1,
                 "simulate": {"episode_median_s": 0.1, "train_s": 6.0}})
    _wait_training(a, gpu)
    b = _create({"kind": "train", "group_size": 2, "tasks_per_step": 1, "steps": 2, "mode": "sync",
                 "simulate": {"episode_median_s": 0.1, "train_s": 0.2}})
    _kill_pool_child(gpu)
    wait_for(lambda: _run_status(b) in ("completed", "failed"), 90,
             what=lambda: f"run B to finish while A's step is lost\n{gpu.output()[-3000:]}")
    with session_scope() as s:
        assert s.get(Run, b).status == "completed" and s.get(Run, b).policy_version == 2
        lost = s.scalar(select(TrainingStep).where(TrainingStep.run_id == a))
        assert (lost.status, lost.error) == ("training", None)  # lost, not failed; nobody re-sent it yet
        assert s.get(Run, a).status == "running" and s.get(Run, a).policy_version == 0
    resent, passes = _watchdog_until_resent(monkeypatch, "the watchdog to re-send A's step")
    assert (a, 0) in resent, passes
    wait_for(lambda: _run_status(a) in ("completed", "failed"), 60,
             what=lambda: f"run A to finish after the re-send\n{gpu.output()[-3000:]}")
    with session_scope() as s:
        assert s.get(Run, a).status == "completed" and s.get(Run, a).policy_version == 1
        assert s.get(Run, b).policy_version == 2  # B untouched by A's recovery


def test_an_eval_run_writes_its_figures_to_tensorboard(env, spawn):
    """Eval runs appear in TensorBoard too: instances solved, resolved rate and reward mean at the end."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from app.config import get_settings

    worker = spawn(celery_worker_args(QUEUES, concurrency=4), env, name="worker")
    run_id = _create({"kind": "eval", "group_size": 4, "tasks_per_step": 2,
                      "simulate": {"episode_median_s": 0.1, "reward_p": 0.5, "seed": 3}})
    wait_for(lambda: _run_status(run_id) in ("completed", "failed"), 90, what=f"run to finish\n{worker.output()[-3000:]}")
    assert _run_status(run_id) == "completed"
    with session_scope() as s:
        summary = s.get(Run, run_id).summary
    from tensorboard.util.tensor_util import make_ndarray

    events = EventAccumulator(str(get_settings().var_dir / "runs" / str(run_id) / "tensorboard"))
    events.Reload()
    tags = events.Tags()["tensors"]  # TensorBoard's torch-free writer stores scalars as tensor summaries

    def value(tag):
        return float(make_ndarray(events.Tensors(tag)[0].tensor_proto))

    assert {"eval/reward_mean", "eval/resolved_rate", "eval/solved_fraction"} <= set(tags), tags
    assert value("eval/resolved_rate") == pytest.approx(summary["resolved_rate"])
    solved = sum(1 for v in summary["solved"].values() if v) / len(summary["solved"])
    assert value("eval/solved_fraction") == pytest.approx(solved)


@pytest.fixture
def private_redis(tmp_path):
    """A Redis server of this test's own (append-only file on, so a restart keeps its data), that
    the test may restart: `restart()` shuts it down (saving) and starts it again on the same port."""
    import subprocess

    import redis as redis_lib

    from support import free_port

    port = free_port()
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
            "--dir", str(tmp_path)]
    procs = [subprocess.Popen(args, stdout=subprocess.DEVNULL)]
    url = f"redis://127.0.0.1:{port}/0"
    client = redis_lib.Redis.from_url(url)
    wait_for(lambda: _pings(client), 10, what="the private Redis to start")

    def restart(down_s: float = 1.0) -> None:
        client.shutdown(save=True)
        procs[-1].wait(timeout=10)
        time.sleep(down_s)
        procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL))
        wait_for(lambda: _pings(client), 10, what="the private Redis to come back")

    yield url, restart
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _pings(client) -> bool:
    import redis as redis_lib

    try:
        return client.ping()
    except redis_lib.RedisError:
        return False


def test_a_redis_restart_keeps_a_rollout_in_flight(database, private_redis, spawn, monkeypatch, tmp_path):
    """Redis restarted (data kept) while a rollout runs on a real worker: the rollout is not cancelled
    and redone; it finishes once, and the run completes."""
    import subprocess
    import sys

    from app import config

    url, restart = private_redis
    env = {"DATABASE_URL": database, "REDIS_URL": url, "TURNSTILE_VAR_DIR": str(tmp_path / "var"),
           "TURNSTILE_LEASE_TTL_S": "30", "TURNSTILE_VISIBILITY_TIMEOUT": "60"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config.reset_settings()
    worker = spawn(celery_worker_args(QUEUES, concurrency=3), env, name="worker")
    with session_scope() as s:
        run = Run(kind="eval", status="queued", config={
            "kind": "eval", "group_size": 1, "tasks_per_step": 1,
            "simulate": {"episode_median_s": 8.0, "episode_sigma": 0.0}})
        s.add(run)
        s.flush()
        run_id = run.id
    subprocess.run([sys.executable, "-c", f"from app.tasks.send import send_start_run; send_start_run({run_id}, 9)"],
                   env={**__import__("os").environ, **env}, check=True)

    def rolling_out():
        with session_scope() as s:
            return s.scalar(select(Episode.id).where(Episode.run_id == run_id, Episode.status == "running",
                                                     Episode.attempts == 1))

    episode_id = wait_for(rolling_out, 60, what=f"the rollout to start\n{worker.output()[-3000:]}")
    time.sleep(1.0)
    restart()
    wait_for(lambda: _run_status(run_id) in ("completed", "failed"), 90,
             what=f"the run to finish after the restart\n{worker.output()[-4000:]}")
    with session_scope() as s:
        ep = s.get(Episode, episode_id)
        assert _run_status(run_id) == "completed", worker.output()[-3000:]
        assert (ep.status, ep.attempts, ep.redeliveries) == ("completed", 1, 0), (
            ep.status, ep.attempts, ep.redeliveries, worker.output()[-3000:])
    assert worker.popen.poll() is None, f"the worker exited on the restart\n{worker.output()[-3000:]}"
