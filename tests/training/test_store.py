"""Stored trajectories on SQLite and PostgreSQL: exact arrays, rejected captures kept with a
reason, merge report on the episode, idempotent rebuilds."""
from __future__ import annotations

import pytest
from sqlalchemy import func, select

from app.db import session_scope
from app.tables import Completion, Episode, Run, TaskInstance, Trajectory
from app.training.store import build_episode_trajectories
from support.episodes import seed_episode


def seed_four_calls() -> int:
    """An episode of four calls: one kept, one without logprobs, one kept after it, one without prompt ids."""
    p1 = [1, 50, 51, 2, 198, 1]
    p2 = p1 + [60, 61, 2] + [198, 1, 70, 2, 198, 1]
    p3 = p2 + [62, 2] + [198, 1, 71, 2, 198, 1]
    return seed_episode([
        (p1, [60, 61, 2], [-0.5, -0.25, -0.125]),
        (p2, [62, 2], None),  # logprobs missing: rejected, its tokens become context
        (p3, [63, 2], [-1.5, -0.75]),
        ([], [5], [-1.0]),  # no prompt ids
    ])


@pytest.mark.parametrize("builder", ["prefix_merging", "per_request"])
def test_build_and_store_is_exact_and_idempotent(any_database, builder):
    episode_id = seed_four_calls()
    with session_scope() as s:
        rows, report = build_episode_trajectories(s, episode_id, builder, vocab_size=49152)
    assert report["rejected"] == 2 and report["rejected_reasons"] == {"missing_logprobs": 1, "missing_prompt_ids": 1}
    with session_scope() as s:
        stored = s.scalars(select(Trajectory).where(Trajectory.episode_id == episode_id).order_by(Trajectory.chain_index)).all()
        comps = s.scalars(select(Completion).where(Completion.episode_id == episode_id).order_by(Completion.seq)).all()
        assert [c.rejected_reason is not None for c in comps] == [False, True, False, True]
        assert comps[1].rejected_reason.startswith("missing_logprobs")
        assert s.get(Episode, episode_id).merge_stats[builder]["chains"] == len(stored)
        if builder == "prefix_merging":
            (t,) = stored
            assert t.token_ids == comps[2].prompt_ids + [63, 2]
            assert t.loss_mask == [0] * 6 + [1, 1, 1] + [0] * (6 + 2 + 6) + [1, 1]
            assert t.logprobs == [0.0] * 6 + [-0.5, -0.25, -0.125] + [0.0] * 14 + [-1.5, -0.75]
            assert t.completion_ids == [comps[0].id, comps[2].id]
        else:
            assert [t.completion_ids for t in stored] == [[comps[0].id], [comps[2].id]]
            assert stored[1].loss_mask == [0] * len(comps[2].prompt_ids) + [1, 1]
    # A second build (a redelivered grading task, then the trainer) returns the stored rows.
    with session_scope() as s:
        again, report2 = build_episode_trajectories(s, episode_id, builder, vocab_size=49152)
        assert [r.id for r in again] == [r.id for r in stored] and report2 == report
        assert s.scalar(select(func.count()).select_from(Trajectory)) == len(stored)


def test_unknown_episode_and_builder(database):
    with session_scope() as s:
        with pytest.raises(LookupError, match="episode 999 does not exist"):
            build_episode_trajectories(s, 999)
    episode_id = seed_four_calls()
    with session_scope() as s:
        with pytest.raises(ValueError, match="unknown trajectory builder"):
            build_episode_trajectories(s, episode_id, "tree")


def test_only_the_current_attempts_rows_are_trained(database):
    """Attempt 1's rows (marked superseded when attempt 2 was claimed, or written late by the dead
    attempt without the mark) give no trainable token; attempt 2's rows are the whole trajectory."""
    with session_scope() as s:
        run = Run(kind="train", config={})
        inst = TaskInstance(task_set="t", instance_id="x__2", repo="x/x", record={})
        s.add_all([run, inst])
        s.flush()
        ep = Episode(run_id=run.id, instance_id=inst.id, group_index=0, sample_index=0, status="completed",
                     reward=1.0, attempts=2)
        s.add(ep)
        s.flush()
        old = dict(prompt_ids=[1, 2, 3], sampled_ids=[7] * 64, logprobs=[-0.1] * 64, finish_reason="stop")
        for seq, reason in enumerate(["superseded: attempt 1 was lost with its worker"] * 3 + [None]):
            s.add(Completion(episode_id=ep.id, seq=seq, attempt=1, request_key=f"a1-{seq}", api="chat",
                             raw_request={}, rejected_reason=reason, **old))
        s.add(Completion(episode_id=ep.id, seq=4, attempt=2, request_key="a2-0", api="chat", raw_request={},
                         prompt_ids=[1, 2, 3], sampled_ids=[8, 9], logprobs=[-0.5, -0.25], finish_reason="stop"))
        episode_id = ep.id
    with session_scope() as s:
        rows, report = build_episode_trajectories(s, episode_id, "per_request", vocab_size=49152)
        assert sum(sum(t.loss_mask) for t in rows) == 2 and [t.token_ids for t in rows] == [[1, 2, 3, 8, 9]]
        assert report["rejected"] == 0
    with session_scope() as s:  # the same rows as attempt 1 alone: nothing trainable
        s.get(Episode, episode_id).attempts = 1
        s.query(Completion).filter(Completion.attempt == 1).update({"rejected_reason": "superseded: x"})
    with session_scope() as s:
        rows, _ = build_episode_trajectories(s, episode_id, "prefix_merging", vocab_size=49152)
        assert sum(sum(t.loss_mask) for t in rows) == 0
