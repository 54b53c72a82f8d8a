"""Build an episode's trajectories from its stored completions and store them, idempotently.

Reads `Completion` rows, runs a builder from `app.training.trajectories`, writes
`Completion.rejected_reason` for captures that cannot be trained on (they stay in the
table for inspection), inserts one `Trajectory` row per chain under the unique
(episode, builder, chain_index) key, and records the builder's report in
`Episode.merge_stats[builder]`.  Calling it again returns the stored rows unchanged.
"""
from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.models import Completion, Episode, Trajectory
from app.training.trajectories import CompletionRecord, build


def completion_records(session: Session, episode_id: int) -> tuple[list[Completion], list[CompletionRecord]]:
    """The episode's completion rows in `seq` order and their `CompletionRecord`s."""
    rows = list(session.scalars(select(Completion).where(Completion.episode_id == episode_id).order_by(Completion.seq)))
    records = [
        CompletionRecord(
            seq=row.seq,
            prompt_ids=row.prompt_ids,
            sampled_ids=row.sampled_ids,
            logprobs=row.logprobs,
            finish_reason=row.finish_reason,
            completion_id=row.id,
            policy_version=row.policy_version,
        )
        for row in rows
    ]
    return rows, records


def stored_trajectories(session: Session, episode_id: int, builder: str) -> list[Trajectory]:
    return list(
        session.scalars(
            select(Trajectory)
            .where(Trajectory.episode_id == episode_id, Trajectory.builder == builder)
            .order_by(Trajectory.chain_index)
        )
    )


def build_episode_trajectories(
    session: Session, episode_id: int, builder: str = "prefix_merging", vocab_size: int | None = None
) -> tuple[list[Trajectory], dict]:
    """Build (or load) the `Trajectory` rows of one episode with `builder`.

    Returns `(rows ordered by chain_index, report)`; the report is also stored in
    `Episode.merge_stats[builder]`.  `vocab_size` bounds valid token ids.  Idempotent: when
    rows for (episode, builder) exist they are returned as stored; a concurrent builder
    that loses the unique-key race reads the winner's rows.  The caller commits.
    Raises `LookupError` for an unknown episode and `ValueError` for an unknown builder.
    """
    episode = session.get(Episode, episode_id)
    if episode is None:
        raise LookupError(f"episode {episode_id} does not exist")
    existing = stored_trajectories(session, episode_id, builder)
    stats = dict(episode.merge_stats or {})
    if existing or builder in stats:
        return existing, stats.get(builder, {})

    rows, records = completion_records(session, episode_id)
    result = build(builder, records, vocab_size)
    try:
        with session.begin_nested():
            for index, reason in result.rejected.items():
                if rows[index].rejected_reason != reason:
                    rows[index].rejected_reason = reason
            trajectories = []
            for chain_index, seq in enumerate(result.sequences):
                trajectories.append(
                    Trajectory(
                        episode_id=episode_id,
                        builder=builder,
                        chain_index=chain_index,
                        token_ids=seq.token_ids,
                        loss_mask=seq.loss_mask,
                        logprobs=seq.logprobs,
                        completion_ids=seq.completions,
                        meta={
                            "spans": [list(span) for span in seq.spans],
                            "policy_versions": seq.policy_versions,
                            "finish_reasons": seq.finish_reasons,
                        },
                    )
                )
            session.add_all(trajectories)
            stats[builder] = result.report
            episode.merge_stats = stats  # reassign: JSON columns do not track in-place edits
    except IntegrityError:
        # Another process stored this episode's chains first; theirs are equal to ours.
        session.expire_all()
        return stored_trajectories(session, episode_id, builder), (session.get(Episode, episode_id).merge_stats or {}).get(builder, {})
    return trajectories, result.report
