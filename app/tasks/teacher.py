"""`teacher` queue: distillation teachers prefill-score the chains of a training step.

`gpu.train_step` of a run with `training.algorithm` 'opd' or 'grpo+opd' sends
`teacher.score_step` first; the training step waits until every trainable chain of its
episodes has a score in SQL (`app.training.opd.wait_for_scores`).  The task is idempotent
(scores are cached by chain hash and teacher version), so a redelivery only re-checks.  torch is
imported in the task body, in the prefork child.  A teacher error (weights that cannot be
loaded, an engine without prompt logprobs, NaN logprobs) fails the run with that cause.
"""
from __future__ import annotations

from celery import shared_task


@shared_task(name="teacher.score_step", ignore_result=True)
def score_step(run_id: int, step: int, episode_ids: list[int] | None = None) -> dict:
    """Score the chains of step `step`'s episodes (its `TrainingStep` row's, else `episode_ids`).

    Returns the `ScoreReport` as a dict, or `{"error": …}` after failing the run.
    """
    from app.training.teacher import score_step as run

    return run(run_id, step, episode_ids)
