"""`rollout` queue: the Tinker service's `sample` futures (thin: `app.control.tinker_sample_future`).

Acknowledged late: a sample changes no tenant state, so a message redelivered after its worker
died is answered again (the future's claim makes sure one worker at a time answers it).
"""
from __future__ import annotations

from celery import shared_task

from app.control import tinker_sample_future


@shared_task(name="app.tasks.tinker_sample.sample_future", acks_late=True, reject_on_worker_lost=True,
             ignore_result=True)
def sample_future(future_id: int) -> str:
    """Answer Tinker sample future `future_id`: "completed", "failed" or "skipped"."""
    return tinker_sample_future.run(int(future_id))
