"""A real gpu worker (workers/gpu_worker.py, prefork, real Redis broker) runs gpu.train_step:
torch lives only in the child, and the model stays resident from one step to the next."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from sqlalchemy import select

from app.celery import app as celery_app
from app.db import session_scope
from app.tables import Run, TrainingStep
from app.tasks.training import train_step
from support import REDIS_BASE

REDIS_DB = 14
BROKER = f"{REDIS_BASE}/{REDIS_DB}"


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_gpu_worker_runs_steps_with_resident_model(var_dir, engine, data, redis_db):
    run_id = data.run([engine.url])
    first = data.group(run_id, 0, [1.0, 0.0], seed=1)
    second = data.group(run_id, 1, [0.0, 1.0], seed=2)
    with session_scope() as s:  # the rows the scheduler creates before enqueueing
        s.add_all([TrainingStep(run_id=run_id, step=0, episode_ids=first),
                   TrainingStep(run_id=run_id, step=1, episode_ids=second)])
    env = {**os.environ, "CELERY_BROKER_URL": BROKER, "CELERY_RESULT_BACKEND": BROKER, "PYTHONPATH": str(data.root)}
    worker = subprocess.Popen(
        [sys.executable, "-m", "workers.gpu_worker", "--loglevel", "WARNING", "-n", f"gpu-test-{uuid.uuid4().hex[:6]}@%h"],
        cwd=data.root, env=env,
    )
    try:
        with celery_app.connection_for_write(BROKER) as conn:
            train_step.apply_async(args=[run_id, 0], connection=conn)
            train_step.apply_async(args=[run_id, 1], connection=conn)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            with session_scope() as s:
                rows = s.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id).order_by(TrainingStep.step)).all()
                if all(r.status == "completed" for r in rows):
                    break
            assert worker.poll() is None, "the gpu worker exited"
            time.sleep(1)
        assert [r.status for r in rows] == ["completed", "completed"], [(r.status, r.error) for r in rows]
        assert [r.policy_version for r in rows] == [1, 2]
        # Step 0 loaded the model; step 1 found it (and the optimizer) resident in the child.
        assert [r.metrics["trainer_resident"] for r in rows] == [False, True]
        with session_scope() as s:
            assert s.get(Run, run_id).policy_version == 2
        kids = children(worker.pid)
        assert len(kids) == 1 and maps_torch(kids[0]) and not maps_torch(worker.pid)
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(10)
