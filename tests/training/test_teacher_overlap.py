"""Teacher scoring overlapped with rollouts: a graded episode of a distillation run is sent to the
`teacher` queue at once (real Redis broker) and scored there, so its step later finds its chains
cached; runs without a teacher, simulated runs, `score_as_graded: false` and episodes not
graded are not sent."""
from __future__ import annotations

import pytest
from sqlalchemy import update

from app.db import session_scope
from app.tables import Episode, Run
from app.tasks.teacher import send_if_graded
from app.training import teacher

REDIS_DB = 10


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def waiting(redis_db, queue: str) -> int:
    """Messages waiting in a kombu Redis queue (one list per priority step: `queue`, `queue:N`)."""
    return sum(redis_db.llen(k) for k in redis_db.keys(f"{queue}*")
               if k.decode() in {queue, *(f"{queue}:{n}" for n in range(10))})


def test_a_graded_episode_is_scored_at_once_and_its_step_finds_it_cached(var_dir, data, teacher_dir, redis_db):
    run_id = data.run([], {"algorithm": "opd", "teacher": {"checkpoint": teacher_dir}, "learning_rate": 1e-5})
    first, second = data.group(run_id, 0, [1.0, 0.0], seed=1)
    assert send_if_graded(first) is True
    assert waiting(redis_db, "teacher") == 1
    early = teacher.score_episode(run_id, first)  # what the teacher worker runs for that message
    assert early["scored"] >= 1 and early["cached"] == 0
    at_step = teacher.score_episodes(run_id, [first, second])  # the step's own scoring
    assert at_step.cached == early["scored"] and at_step.scored >= 1


@pytest.mark.parametrize("change", ["grpo", "off", "simulated", "not graded", "cancelled"])
def test_what_is_not_scored_as_graded(var_dir, data, teacher_dir, redis_db, change):
    training = {"algorithm": "opd", "teacher": {"checkpoint": teacher_dir, "score_as_graded": change != "off"}}
    if change == "grpo":
        training = {"algorithm": "grpo"}
    run_id = data.run([], training)
    (episode,) = data.group(run_id, 0, [0.0], seed=2)
    with session_scope() as s:
        if change == "simulated":
            run = s.get(Run, run_id)
            run.config = {**run.config, "simulate": {"episode_median_s": 0.05}}
        if change == "not graded":
            s.execute(update(Episode).where(Episode.id == episode).values(status="grading"))
        if change == "cancelled":
            s.execute(update(Run).where(Run.id == run_id).values(status="cancelled"))
    assert teacher.scores_as_graded(episode) is None
    assert send_if_graded(episode) is False
    assert waiting(redis_db, "teacher") == 0
    if change == "cancelled":
        assert "skipped" in teacher.score_episode(run_id, episode)
