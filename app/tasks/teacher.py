"""`teacher` queue: distillation teachers prefill-score the chains of a training step.

Each graded episode of a run with `training.algorithm` 'opd' or 'grpo+opd' is sent as
`teacher.score_episode` at once (`send_if_graded`, called by the grade task), so the teacher
scores while the step's other episodes still roll out; `gpu.train_step` sends
`teacher.score_step` first, which scores what is still missing, and the training step waits
until every trainable chain of its episodes has a score in SQL (`app.training.opd.wait_for_scores`).  The task is idempotent
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


@shared_task(name="teacher.score_episode", ignore_result=True)
def score_episode(run_id: int, episode_id: int) -> dict:
    """Score the chains of one graded episode (see `app.training.teacher.score_episode`)."""
    from app.training.teacher import score_episode as run

    return run(run_id, episode_id)


def send_if_graded(episode_id: int) -> bool:
    """Send `teacher.score_episode` when the episode was just graded in a distillation run that
    scores as graded (`app.training.teacher.scores_as_graded`); whether it was sent."""
    from app.training.teacher import scores_as_graded

    run_id = scores_as_graded(episode_id)
    if run_id is None:
        return False
    score_episode.apply_async((run_id, episode_id), queue="teacher")
    return True
