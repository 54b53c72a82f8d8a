"""`prepare`, `rollout` and `grade` queues: one task per episode stage.

Late acknowledgement + reject-on-worker-lost (app/celery.py) make a task whose worker
died come back; the compare-and-set claims in `app.control.episodes` make that safe.
Soft time limits leave the stage a moment to record the failure.
"""
from __future__ import annotations

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded

from app.control import episodes
from app.tasks.send import send
from app.tasks.teacher import send_if_graded


@shared_task(name="prepare.prepare_episode", acks_late=True)
def prepare_episode(episode_id: int) -> None:
    try:
        send(episodes.prepare(episode_id))
    except SoftTimeLimitExceeded:
        send(episodes.fail(episode_id, "prepare exceeded its time limit"))


@shared_task(name="rollout.run_episode", acks_late=True)
def run_episode(episode_id: int) -> None:
    try:
        send(episodes.rollout(episode_id))
    except SoftTimeLimitExceeded:
        send(episodes.fail(episode_id, "rollout exceeded the worker's time limit"))


@shared_task(name="grade.grade_episode", acks_late=True)
def grade_episode(episode_id: int) -> None:
    try:
        send(episodes.grade(episode_id))
    except SoftTimeLimitExceeded:
        send(episodes.fail(episode_id, "grading exceeded its time limit"))
        return
    send_if_graded(episode_id)  # distillation: the teacher scores the graded episode's chains now
