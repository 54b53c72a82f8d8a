"""The distillation teacher: prefill-scores the exact token ids of each trainable chain.

    score_episodes(run_id, episode_ids)    (sent per episode as soon as it is graded, and per step)
      trajectories  built (or loaded) per episode with the run's builder (after prefix merging)
      cache         a chain whose (chain_hash, teacher_version) has a `TeacherScore` is skipped
      score         one prefill pass of the teacher over the chain's ids; the teacher's logprob of
                    every sampled token (loss mask 1), 0.0 elsewhere: float32 [T], stored as
                    `TeacherScore.logprobs`, the same packed array type as `Trajectory.logprobs`

With `training.opd_divergence` topk_forward_kl (k = `opd_topk`) each score also keeps the
teacher's k likeliest tokens and their logprobs at every sampled position (`ChainScore`,
stored as `TeacherScore.top_ids` / `top_logprobs`), under the key `score_key` (the teacher
version with the k), so a run with another k never reads them.

The scorers (`LocalScorer`: the teacher's weights in this process, bit-exact on CPU, so
`rescore_episode` reproduces stored values from SQL; `RemoteScorer`: engines' `prompt_logprobs`)
are `app.training.teacher_scorers`.  Any failure is a `TeacherError` naming the cause: a teacher
that cannot be loaded, an engine without prompt logprobs, a NaN or positive logprob, a length
mismatch; `score_step` and `score_episode` fail the run with it.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from app.db import session_scope
from app.runconfig import TeacherChoice
from app.tables import Episode, Run, TeacherScore, Trajectory
from app.training.store import build_episode_trajectories
from app.training.teacher_check import TeacherError, check_local_tokenizer, student_source
from app.training.teacher_scorers import ChainScore, LocalScorer, scorer_for, teacher_spec

log = logging.getLogger(__name__)


def chain_hash(token_ids, loss_mask) -> str:
    """SHA-256 (hex, 64 chars) of a chain's token ids (int32 LE) and loss mask (uint8)."""
    digest = hashlib.sha256()
    digest.update(np.asarray(token_ids, dtype="<i4").tobytes())
    digest.update(b"|")
    digest.update(np.asarray(loss_mask, dtype=np.uint8).tobytes())
    return digest.hexdigest()


_VERSIONS: dict[tuple, str] = {}


def teacher_version(teacher: TeacherChoice) -> str:
    """The cache key of the teacher's weights (at most 128 chars).

    `teacher.version` when given; for a checkpoint folder `ckpt:` + SHA-256 of its weight files'
    bytes (so rewritten weights at the same path get new scores); for engines `engine:<name>`;
    for 'tiny' / 'smollm2' the name.  Raises `TeacherError` for a missing checkpoint.
    """
    if teacher.version:
        return teacher.version
    if teacher.engine_urls:
        return f"engine:{teacher.name}"[:128]
    spec = teacher_spec(teacher)
    folder = Path(spec)
    if not folder.is_dir():
        return spec[:128]
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") or p.name == "config.json")
    key = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if (spec, key) not in _VERSIONS:
        digest = hashlib.sha256()
        for p in files:
            digest.update(p.name.encode())
            with open(p, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 22), b""):
                    digest.update(block)
        _VERSIONS[(spec, key)] = "ckpt:" + digest.hexdigest()
    return _VERSIONS[(spec, key)]


def score_key(teacher: TeacherChoice, top: int = 0) -> str:
    """`TeacherScore.teacher_version` of scores by `teacher` with `top` (k) tokens per position
    (at most 128 chars): `teacher_version` alone for k = 0, else with `|top{k}` (hashed when
    the two would pass 128 chars).  Raises `TeacherError` as `teacher_version`."""
    version = teacher_version(teacher)
    if not top:
        return version
    key = f"{version}|top{top}"
    return key if len(key) <= 128 else "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@dataclass
class ScoreReport:
    """What one `score_episodes` call did: chains scored now, found cached, without trainable tokens."""

    scored: int = 0
    cached: int = 0
    empty: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"scored": self.scored, "cached": self.cached, "empty": self.empty, "seconds": self.seconds}


def score_episodes(run_id: int, episode_ids: list[int], scorer=None) -> ScoreReport:
    """Score every trainable chain of the episodes with run `run_id`'s teacher; idempotent.

    Chains come from the run's builder (built here if the trainer has not yet).  A chain whose
    (hash, teacher version) is stored is skipped.  Raises LookupError (unknown run), ValueError
    (the run has no teacher), `TeacherError` (see the class).
    """
    with session_scope() as s:
        run = s.get(Run, run_id)
        if run is None:
            raise LookupError(f"run {run_id} does not exist")
        run_cfg = run.run_config()
        cfg = run_cfg.training
    if cfg.teacher is None:
        raise ValueError(f"run {run_id} has no teacher (training.algorithm is {cfg.algorithm!r})")
    top = cfg.opd_top
    version = score_key(cfg.teacher, top)
    report = ScoreReport()
    if scorer is None:
        scorer = scorer_for(cfg.teacher)
        if isinstance(scorer, LocalScorer):  # creation checked it too, unless the tokenizer cache was not written
            check_local_tokenizer(student_source(run_cfg), scorer.spec)
    vocab = getattr(scorer, "vocab_size", None)
    for episode_id in episode_ids:
        with session_scope() as s:
            rows, _report = build_episode_trajectories(s, episode_id, cfg.builder, vocab)
            chains = {chain_hash(r.token_ids, r.loss_mask): (list(r.token_ids), list(r.loss_mask))
                      for r in rows if any(r.loss_mask)}
            report.empty += sum(1 for r in rows if not any(r.loss_mask))
            have = set(s.scalars(select(TeacherScore.chain_hash).where(
                TeacherScore.teacher_version == version, TeacherScore.chain_hash.in_(list(chains))))) if chains else set()
        for digest, (ids, mask) in chains.items():
            if digest in have:
                report.cached += 1
                continue
            started = time.perf_counter()
            score = scorer.score_top(ids, mask, top) if top else ChainScore(scorer.score(ids, mask))
            seconds = time.perf_counter() - started
            report.scored += 1
            report.seconds += seconds
            flat = ({"top_k": top, "top_ids": [i for row in score.top_ids for i in row],
                     "top_logprobs": [v for row in score.top_logprobs for v in row]} if top else {})
            try:
                with session_scope() as s:
                    s.add(TeacherScore(chain_hash=digest, teacher_version=version, logprobs=score.logprobs,
                                       tokens=int(sum(mask)), seconds=seconds, **flat))
            except IntegrityError:
                log.info("run=%s chain %s was scored by another process", run_id, digest[:12])
    return report


def stored_scores(session, rows: list[Trajectory], version: str) -> dict[str, TeacherScore]:
    """The stored scores of `rows` (trajectories) under teacher `version`, by chain hash."""
    hashes = [chain_hash(r.token_ids, r.loss_mask) for r in rows]
    if not hashes:
        return {}
    found = session.scalars(select(TeacherScore).where(TeacherScore.teacher_version == version,
                                                       TeacherScore.chain_hash.in_(hashes)))
    return {row.chain_hash: row for row in found}


def rescore_episode(episode_id: int, teacher: TeacherChoice | None = None, scorer=None) -> list[dict]:
    """Score an old episode's stored chains again from SQL and compare with the stored scores.

    `teacher` defaults to the episode's run's teacher; with the run's `opd_topk` scores, the
    top-k logprobs and ids are compared too.  Returns one dict per trainable chain:
    `{"chain_index", "chain_hash", "stored": bool, "bit_exact": bool | None, "max_abs_diff"}`
    (`max_abs_diff` over logprobs, nats; with top-k also `top_ids_equal`)
    (bit_exact None when nothing was stored).  Writes nothing.
    """
    with session_scope() as s:
        episode = s.get(Episode, episode_id)
        if episode is None:
            raise LookupError(f"episode {episode_id} does not exist")
        cfg = s.get(Run, episode.run_id).run_config().training
        teacher = teacher or cfg.teacher
        if teacher is None:
            raise ValueError(f"episode {episode_id}'s run has no teacher")
        rows = list(s.scalars(select(Trajectory).where(Trajectory.episode_id == episode_id,
                                                       Trajectory.builder == cfg.builder)
                              .order_by(Trajectory.chain_index)))
        top = cfg.opd_top
        version = score_key(teacher, top)
        stored = {h: (list(r.logprobs) + list(r.top_logprobs or []), list(r.top_ids or []))
                  for h, r in stored_scores(s, rows, version).items()}
        chains = [(r.chain_index, list(r.token_ids), list(r.loss_mask)) for r in rows if any(r.loss_mask)]
    scorer = scorer or scorer_for(teacher)
    out = []
    for index, ids, mask in chains:
        digest = chain_hash(ids, mask)
        fresh_ids: list[int] = []
        if top:  # the sampled tokens' logprobs then the top-k ones; the top-k ids compared apart
            score = scorer.score_top(ids, mask, top)
            fresh = np.asarray(score.logprobs + [v for row in score.top_logprobs for v in row], dtype=np.float32)
            fresh_ids = [i for row in score.top_ids for i in row]
        else:
            fresh = np.asarray(scorer.score(ids, mask), dtype=np.float32)
        old = stored.get(digest)
        entry = {"chain_index": index, "chain_hash": digest, "stored": old is not None, "bit_exact": None,
                 "max_abs_diff": None}
        if old is not None:
            old_arr = np.asarray(old[0], dtype=np.float32)
            entry["bit_exact"] = old_arr.tobytes() == fresh.tobytes() and old[1] == fresh_ids
            entry["max_abs_diff"] = float(np.max(np.abs(old_arr - fresh))) if fresh.size else 0.0
            if top:
                entry["top_ids_equal"] = old[1] == fresh_ids
        out.append(entry)
    return out


def score_step(run_id: int, step: int, episode_ids: list[int] | None = None) -> dict:
    """`score_episodes` for training step `step` (episodes from its `TrainingStep` row, else
    `episode_ids`); a `TeacherError` fails the run with the cause (`Run.error` "teacher: …").

    Returns the report as a dict, `{"error": …}` after failing the run, or `{"skipped": …}`
    when the run is not running.
    """
    from app.tables import TrainingStep

    with session_scope() as s:
        run = s.get(Run, run_id)
        if run is None:
            raise LookupError(f"run {run_id} does not exist")
        if run.status != "running":
            return {"skipped": f"run {run_id} is {run.status}"}
        row = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id, TrainingStep.step == step))
        ids = list((row.episode_ids if row is not None else None) or episode_ids or [])
    return _score_or_fail(run_id, ids, f"step={step}")


def _score_or_fail(run_id: int, episode_ids: list[int], where: str) -> dict:
    """`score_episodes`; a `TeacherError` fails the run with the cause and gives `{"error": …}`."""
    from app.tables import utcnow
    from app.transitions import transition

    try:
        return score_episodes(run_id, episode_ids).as_dict()
    except TeacherError as exc:
        error = f"teacher: {exc}"[:2000]
        log.error("run=%s %s %s", run_id, where, error)
        with session_scope() as s:
            transition(s, Run, run_id, "failed", error=error, finished_at=utcnow())
        return {"error": error}


def scores_as_graded(episode_id: int) -> int | None:
    """The run id when episode `episode_id` should be scored now, as soon as it is graded, or None.

    Yes for a completed episode of a running train run with a teacher (`training.algorithm`
    'opd' or 'grpo+opd', not simulated) whose `teacher.score_as_graded` is on: its trajectories
    are built at grading, so the teacher can score its chains while the step's other episodes
    still roll out, instead of all of them after the step's last grade.  SQL only (no torch).
    """
    with session_scope() as s:
        episode = s.get(Episode, episode_id)
        if episode is None or episode.status != "completed":
            return None
        run = s.get(Run, episode.run_id)
        if run is None or run.status != "running" or run.kind != "train":
            return None
        run_id, cfg = run.id, run.run_config()
    teacher = cfg.training.teacher
    if cfg.training.algorithm == "grpo" or teacher is None or cfg.simulate is not None or not teacher.score_as_graded:
        return None
    return run_id


def score_episode(run_id: int, episode_id: int) -> dict:
    """Score one graded episode's chains for run `run_id` (the teacher queue's early work; the
    step's own `score_step` later finds them cached).  Returns the report, `{"error": …}` after
    failing the run, or `{"skipped": …}` when the run is not running."""
    with session_scope() as s:
        run = s.get(Run, run_id)
        if run is None or run.status != "running":
            return {"skipped": f"run {run_id} is {run.status if run else 'gone'}"}
    return _score_or_fail(run_id, [episode_id], f"episode={episode_id}")
