"""Every Celery message Turnstile sends: a control `Plan`'s, and the API's start and cancel of a run.

Messages are sent by task name (`app.send_task`), so this module imports no task module and
the control code never imports Celery.  Callers send only after their transaction committed.
"""
from __future__ import annotations

from app.celery import app as celery_app
from app.control.plan import Plan


def send(plan: Plan | None) -> None:
    """Send every message of `plan` (episodes at the plan's priority; steps and ticks at the highest)."""
    if not plan:
        return
    for episode_id in plan.prepare:
        celery_app.send_task("prepare.prepare_episode", args=[episode_id], priority=plan.priority)
    for episode_id in plan.rollout:
        celery_app.send_task("rollout.run_episode", args=[episode_id], priority=plan.priority)
    for episode_id in plan.grade:
        celery_app.send_task("grade.grade_episode", args=[episode_id], priority=plan.priority)
    for run_id, step in plan.train:
        send_train_step(run_id, step)
    for run_id in plan.tick:
        celery_app.send_task("control.tick", args=[run_id])
    for run_id in plan.start:
        celery_app.send_task("control.start_run", args=[run_id])


def send_train_step(run_id: int, step: int) -> None:
    """Send step `step` of run `run_id` to the gpu queue; a tick follows it, success or failure."""
    celery_app.send_task(
        "gpu.train_step", args=[run_id, step],
        link=celery_app.signature("control.tick", args=[run_id], immutable=True),
        link_error=celery_app.signature("control.step_failed", args=[run_id, step]),
    )


def send_start_run(run_id: int, priority: int) -> None:
    """Send `control.start_run` for a run the API just created (committed), at Celery priority `priority`."""
    celery_app.send_task("control.start_run", args=[run_id], priority=priority)


def send_cancel_run(run_id: int) -> None:
    """Send `control.cancel_run` for a run the API just moved to `cancelling` (committed)."""
    celery_app.send_task("control.cancel_run", args=[run_id], priority=9)


# The Tinker service's ops (app.tinker): gpu ops to the trainer, sampling to the rollout workers.
# The task names are the tasks' module paths (Celery's default name of a task without `name=`).
TINKER_GPU_TASK = "app.tasks.tinker.run_future"
TINKER_SAMPLE_TASK = "app.tasks.tinker_sample.sample_future"
TINKER_SAMPLE_OPS = ("sample",)


def send_tinker_future(future_id: int, op: str) -> None:
    """Send Tinker future `future_id` (committed) to its worker: `sample` to the rollout queue, every
    other op (forward, forward_backward, optim_step, save/load weights ...) to the gpu queue."""
    if op in TINKER_SAMPLE_OPS:
        celery_app.send_task(TINKER_SAMPLE_TASK, args=[future_id], queue="rollout")
    else:
        celery_app.send_task(TINKER_GPU_TASK, args=[future_id], queue="gpu")
