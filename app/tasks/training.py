"""`gpu` queue: training steps (thin: the work is the run's stages, `app.training.steps` for real runs).

Acknowledged on start, not late: a training step
must never run twice at once, and a redelivery after Redis's visibility timeout would do
exactly that.  The database row is the truth instead: a step left in `training` by a killed
worker resumes from its checkpoint when `gpu.train_step` is sent again, and a completed step
is a no-op.  torch is imported inside the task body, in the prefork child, never in the
parent (CUDA cannot be re-initialised after fork); the model and optimizer then stay
resident in that child across steps (`app.training.steps._RESIDENT`).
"""
from __future__ import annotations

import time

from celery import shared_task

from app.control import trainer_shares
from app.control.runs import stages_for
from app.db import session_scope
from app.tables import Run


@shared_task(name="gpu.train_step", acks_late=False, reject_on_worker_lost=False, ignore_result=True)
def train_step(run_id: int, step: int, episode_ids: list[int] | None = None) -> dict:
    """Run training step `step` of run `run_id`; returns `{run_id, step, policy_version}`.

    Raises LookupError for an unknown run; the errors of the run's training stage otherwise.
    """
    with session_scope() as s:
        run = s.get(Run, run_id)
        if run is None:
            raise LookupError(f"run {run_id} does not exist")
        cfg = run.run_config()
    if cfg.training.algorithm != "grpo" and cfg.simulate is None:
        # The teacher scores the step's chains on its own queue; the step waits for the scores in SQL.
        from app.tasks.teacher import score_step

        score_step.apply_async((run_id, step, episode_ids), queue="teacher")
    start = time.perf_counter()
    try:
        metrics = stages_for(cfg).train(run_id, step, episode_ids)
    finally:  # its turn on the trainer, which Tinker ops weigh theirs against (app.control.trainer_shares)
        trainer_shares.record(run_id, time.perf_counter() - start)
    return {"run_id": run_id, "step": step, "policy_version": metrics.get("policy_version")}
