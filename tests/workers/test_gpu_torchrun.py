"""The gpu worker under torchrun (workers/gpu_torchrun.py): 2 gloo ranks on CPU, rank 0 the
Celery worker of queue `gpu` on a real Redis broker, rank 1 following its trainer calls.
One `gpu.train_step` sent through the broker trains the step sharded with FSDP2, writes the
checkpoint, syncs the engine and completes the row, with the metrics of the same step
trained in one process."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis as redis_lib
from sqlalchemy import select

from app.celery import app as celery_app
from app.db import session_scope
from app.engines.modeling import read_metadata
from app.tables import Run, TrainingStep
from app.tasks.training import train_step
from app.training import steps
from support import REDIS_BASE

REDIS_DB = 9
BROKER = f"{REDIS_BASE}/{REDIS_DB}"
# One sequence per micro-batch (padded, ~40 tokens each): 4 micro-batches, 2 real ones per rank.
TRAINING = {"micro_batch_tokens": 48}


def _seed(data, engine_url: str) -> tuple[int, list[int]]:
    """A run with two groups sampled from the tiny model (the same seeds give the same data)."""
    run_id = data.run([engine_url], TRAINING)
    episode_ids = data.group(run_id, 0, [1.0, 0.0], seed=1) + data.group(run_id, 1, [0.0, 1.0], seed=2)
    return run_id, episode_ids


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return found


def _kill_torchrun(proc: subprocess.Popen) -> None:
    """Kill torchrun's process group and each rank's: torchrun starts every rank in a session
    of its own, so killing torchrun's group alone would leave the ranks running."""
    ranks = _children(proc.pid) if proc.poll() is None else []
    for pgid in [proc.pid, *ranks]:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)


def _step_row(run_id: int) -> TrainingStep | None:
    with session_scope() as s:
        return s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id, TrainingStep.step == 0))


@pytest.mark.slow
def test_torchrun_gpu_worker_trains_a_step_sent_through_celery(var_dir, engine, data, database, tmp_path):
    broker = redis_lib.Redis.from_url(BROKER)
    broker.flushdb()
    run_id, episode_ids = _seed(data, engine.url)
    with session_scope() as s:  # the row the scheduler creates before enqueueing
        s.add(TrainingStep(run_id=run_id, step=0, episode_ids=episode_ids))

    # CPU and gloo: no GPU visible to the ranks; one thread each (2 ranks share a small box).
    env = {**os.environ, "PYTHONPATH": str(data.root), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "DATABASE_URL": database, "TURNSTILE_VAR_DIR": str(var_dir),
           "REDIS_URL": BROKER, "CELERY_BROKER_URL": BROKER, "CELERY_RESULT_BACKEND": BROKER}
    log_path = tmp_path / "torchrun.log"
    log = open(log_path, "wb")
    group = subprocess.Popen(
        [str(data.root / ".venv/bin/torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "workers.gpu_torchrun",
         "--loglevel", "INFO", "-n", f"gpu-torchrun-{uuid.uuid4().hex[:6]}@%h"],
        cwd=data.root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        with celery_app.connection_for_write(BROKER) as conn:
            train_step.apply_async(args=[run_id, 0], connection=conn)

        # The same step in this process, alone, on a copy of the data (while the ranks start).
        alone_engine = data.Engine()
        try:
            alone_run, alone_episodes = _seed(data, alone_engine.url)
            alone = steps.train_step(alone_run, 0, alone_episodes)
        finally:
            alone_engine.close()
            steps.reset_resident()

        deadline = time.monotonic() + 240
        row = _step_row(run_id)
        while time.monotonic() < deadline and row.status != "completed":
            assert group.poll() is None, "torchrun exited:\n" + log_path.read_text(errors="replace")[-6000:]
            time.sleep(1)
            row = _step_row(run_id)
        assert row.status == "completed", ((row.status, row.error), log_path.read_text(errors="replace")[-6000:])
    finally:
        _kill_torchrun(group)
        log.close()
        broker.flushdb()
        broker.close()

    metrics = row.metrics
    assert row.policy_version == 1 and row.error is None
    with session_scope() as s:
        assert s.get(Run, run_id).policy_version == 1
    assert metrics["world_size"] == 2 and alone["world_size"] == 1
    assert metrics["micro_batches"] == alone["micro_batches"] == 4

    # The checkpoint: sharded state plus the one-file model the engine loaded.
    ckpt = row.checkpoint_path
    model_dir = f"{ckpt}/model"
    assert os.path.isfile(f"{model_dir}/model.safetensors") and os.path.isfile(f"{ckpt}/sharded/.metadata")
    assert read_metadata(model_dir) == {"policy_version": 1}
    assert engine.loaded == [(model_dir, 1)]
    assert metrics["engine_sync"] == {engine.url: "ok"}

    # FSDP over 2 ranks equals the single-process step up to float summation order.
    for key in ("tokens_trained", "tokens_processed", "sequences", "episodes", "groups"):
        assert metrics[key] == alone[key], key
    for key in ("loss", "grad_norm"):
        assert math.isfinite(metrics[key]), key
        assert metrics[key] == pytest.approx(alone[key], rel=1e-5, abs=1e-7), key
    for key in ("logprob_gap_max_abs", "logprob_gap_mean_abs", "clip_fraction", "tis_weight_mean", "ratio_mean"):
        assert metrics[key] == pytest.approx(alone[key], rel=1e-5, abs=1e-7), key
