"""Build an episode's trajectories from its stored completions and store them, idempotently.

Reads the `Completion` rows of the episode's current attempt, runs a builder from
`app.training.trajectories`, writes `Completion.rejected_reason` for captures that cannot
be trained on (they stay in the table for inspection), inserts one `Trajectory` row per chain under the unique
(episode, builder, chain_index) key, and records the builder's report in
`Episode.merge_stats[builder]`.  Calling it again returns the stored rows unchanged.
A chain's `meta["sampling"]` holds the sampling record of each of its spans (the completion's
`normalized_request["turnstile_sampling"]`), which `trajectory_transform` expands per token.
An MoE policy's chain routes (`TrainingSequence.routes`) are stored as
`Trajectory.routed_experts` bytes (`app.engines.route_bytes`), their `[layers, top_k]` as
`meta["route_shape"]`.
"""
from __future__ import annotations

import logging

import numpy as np
from sqlalchemy import and_, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.engines.route_bytes import from_bytes, to_bytes
from app.tables import SUPERSEDED, Completion, Episode, Trajectory
from app.training.trajectories import CompletionRecord, SequenceTransform, build, sequence_transform

log = logging.getLogger(__name__)


def current_attempt_rows(episode_id: int, attempt: int):
    """The condition that selects the completions training may use: those of the episode's
    current rollout `attempt` (`max(Episode.attempts, 1)`), without those marked superseded.
    An earlier attempt's rows, lost with its worker, are kept for inspection and never trained."""
    return and_(Completion.episode_id == episode_id, Completion.attempt == attempt,
                or_(Completion.rejected_reason.is_(None), Completion.rejected_reason.not_like(f"{SUPERSEDED}%")))


def completion_records(session: Session, episode_id: int) -> tuple[list[Completion], list[CompletionRecord]]:
    """The completion rows of the episode's current attempt in `seq` order and their `CompletionRecord`s."""
    episode = session.get(Episode, episode_id)
    attempt = max(episode.attempts or 0, 1) if episode is not None else 1
    rows = list(session.scalars(select(Completion).where(current_attempt_rows(episode_id, attempt))
                                .order_by(Completion.seq)))
    records = [
        CompletionRecord(
            seq=row.seq,
            prompt_ids=row.prompt_ids,
            sampled_ids=row.sampled_ids,
            logprobs=row.logprobs,
            finish_reason=row.finish_reason,
            completion_id=row.id,
            policy_version=row.policy_version,
            sampling=(row.normalized_request or {}).get("turnstile_sampling"),
            policy_versions=row.policy_versions,
            routes=completion_routes(row),
        )
        for row in rows
    ]
    return rows, records


def completion_routes(row: Completion) -> np.ndarray | None:
    """The routed experts stored with completion `row`, int16 [P + S - 1, layers, top_k], or None
    (a dense model; bytes that do not decode with the row's `route_shape` are logged and left
    out, so its chain trains without routing replay)."""
    if row.routed_experts is None:
        return None
    shape = row.route_shape or []
    try:
        if len(shape) != 2:
            raise ValueError(f"route_shape {shape!r} is not [layers, top_k]")
        return from_bytes(row.routed_experts, int(shape[0]), int(shape[1]))
    except (TypeError, ValueError) as exc:
        log.warning("completion %s: stored routed experts unusable: %s", row.id, exc)
        return None


def trajectory_transform(row: Trajectory) -> SequenceTransform | None:
    """The per-token sampling transform of a stored chain (None: every span the identity)."""
    meta = row.meta or {}
    return sequence_transform(len(row.token_ids), meta.get("spans") or [], meta.get("sampling"))


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
                        routed_experts=None if seq.routes is None else to_bytes(seq.routes),
                        meta={
                            "spans": [list(span) for span in seq.spans],
                            "policy_versions": seq.policy_versions,
                            "finish_reasons": seq.finish_reasons,
                            # one sampling record per span (`sequence_transform`); absent: identity
                            **({"sampling": seq.sampling} if any(x is not None for x in seq.sampling) else {}),
                            # per-token versions of spans that cross an in-flight weight update
                            **({"version_runs": seq.version_runs} if any(seq.version_runs) else {}),
                            # [layers, top_k] of `routed_experts` (MoE policies only)
                            **({"route_shape": list(seq.routes.shape[1:])} if seq.routes is not None else {}),
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
