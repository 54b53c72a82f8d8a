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

Two scorers.  `LocalScorer` loads the teacher's weights in this process with the embedded
engine's model code (`app.engines.modeling.load_model`) and runs one fp32 forward per chain:
deterministic on CPU, so re-scoring an old episode from SQL (`rescore_episode`) reproduces the
stored values bit for bit.  `RemoteScorer` asks engines for vLLM's `prompt_logprobs` on
`POST /v1/completions` with the chain as a token-id prompt (vLLM's sampling parameter,
https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html; the embedded engine serves the
same field).  Any failure is a `TeacherError` naming the cause: a teacher that cannot be
loaded, an engine without prompt logprobs, a NaN or positive logprob, a length mismatch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
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
from app.training.teacher_check import (  # noqa: F401 (TeacherError re-exported)
    TeacherError,
    check_local_tokenizer,
    parse_prompt_logprobs,
    parse_prompt_top,
    student_source,
)

log = logging.getLogger(__name__)


def chain_hash(token_ids, loss_mask) -> str:
    """SHA-256 (hex, 64 chars) of a chain's token ids (int32 LE) and loss mask (uint8)."""
    digest = hashlib.sha256()
    digest.update(np.asarray(token_ids, dtype="<i4").tobytes())
    digest.update(b"|")
    digest.update(np.asarray(loss_mask, dtype=np.uint8).tobytes())
    return digest.hexdigest()


def teacher_spec(teacher: TeacherChoice) -> str:
    """The model spec the teacher's weights load from: its checkpoint folder, else its name.

    Raises `TeacherError` for a checkpoint that does not exist.
    """
    if teacher.checkpoint:
        from app.training.checkpoints import resolve_checkpoint

        try:
            return str(resolve_checkpoint(teacher.checkpoint)[0])
        except FileNotFoundError as exc:
            raise TeacherError(f"teacher cannot be loaded: {exc}") from exc
    return str(teacher.name)


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
class ChainScore:
    """A teacher's scores of one chain of T tokens: `logprobs` floats [T] (the sampled tokens',
    0.0 at loss-mask-0 positions); with k > 0 also `top_ids` ints [T][k] and `top_logprobs`
    floats [T][k] (nats, descending; zeros at loss-mask-0 positions), else both empty."""

    logprobs: list[float]
    top_ids: list[list[int]] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[float]] = dataclasses.field(default_factory=list)

    @property
    def top(self) -> int:
        return len(self.top_ids[0]) if self.top_ids else 0


def check_top(ids, values, token_ids, loss_mask, top: int, where: str) -> tuple[list[list[int]], list[list[float]]]:
    """`ids` [T][k] and `values` [T][k] checked: k per position, values finite logprobs <= 0
    (float32-rounded), zeros at loss-mask-0 positions.  Raises `TeacherError` otherwise."""
    if len(ids) != len(token_ids) or len(values) != len(token_ids):
        raise TeacherError(f"{where}: top-{top} teacher tokens for {len(ids)} positions, the chain has {len(token_ids)}")
    out_ids: list[list[int]] = []
    out_values: list[list[float]] = []
    for t, (row_ids, row_values, mask) in enumerate(zip(ids, values, loss_mask)):
        if not mask or t == 0:
            out_ids.append([0] * top)
            out_values.append([0.0] * top)
            continue
        if len(row_ids) != top or len(row_values) != top:
            raise TeacherError(f"{where}: {len(row_ids)} teacher tokens at position {t}, not the {top} asked for")
        row = np.asarray(row_values, dtype=np.float32).tolist()
        if not all(math.isfinite(v) and v <= 1e-4 for v in row):
            raise TeacherError(f"{where}: a top-{top} teacher logprob at position {t} is not a finite value <= 0: {row}")
        out_ids.append([int(i) for i in row_ids])
        out_values.append(row)
    return out_ids, out_values


def check_scores(values, token_ids, loss_mask, where: str) -> list[float]:
    """`values` as float32-rounded floats [T]; raises `TeacherError` when the length differs
    from `token_ids` or a scored value is not a finite logprob <= 0 (NaN included)."""
    if len(values) != len(token_ids):
        raise TeacherError(f"{where}: {len(values)} teacher logprobs for a chain of {len(token_ids)} tokens")
    out = np.asarray(values, dtype=np.float32)
    for i, (value, mask) in enumerate(zip(out.tolist(), loss_mask)):
        if mask and not (math.isfinite(value) and value <= 1e-4):
            raise TeacherError(f"{where}: the teacher's logprob of token {i} (id {token_ids[i]}) is {value!r}, "
                               f"not a finite value <= 0")
    return [v if m else 0.0 for v, m in zip(out.tolist(), loss_mask)]


class LocalScorer:
    """The teacher's weights in this process (fp32, CPU or CUDA): one forward per chain."""

    def __init__(self, spec: str, device=None):
        import torch

        from app.engines.modeling import load_model

        try:
            model, _tokenizer = load_model(spec)
        except (OSError, ValueError, RuntimeError) as exc:
            raise TeacherError(f"teacher {spec!r} cannot be loaded: {exc}") from exc
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # on the CPU it shares the box with the engine and the trainer: the cores they leave
        from app.training.threads import apply_cpu_threads

        apply_cpu_threads(device=self.device)
        self.model = model.to(self.device).eval()
        self.spec = spec
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])

    def score(self, token_ids, loss_mask) -> list[float]:
        """The teacher's logprob (nats) of every token with mask 1, 0.0 elsewhere: floats [T].

        Raises `TeacherError` for ids outside the teacher's vocabulary and bad values."""
        return check_scores(score_with_model(self.model, token_ids, loss_mask, self.device), token_ids, loss_mask,
                            f"teacher {self.spec}")

    def score_top(self, token_ids, loss_mask, top: int) -> ChainScore:
        """`score` and the teacher's `top` likeliest tokens at each mask-1 position (`ChainScore`).

        Raises `TeacherError` as `score`."""
        where = f"teacher {self.spec}"
        if any(not 0 <= int(i) < self.vocab_size for i in token_ids):
            raise TeacherError(f"{where}: a token id is outside the teacher's vocabulary of {self.vocab_size}")
        values, ids, top_values = top_with_model(self.model, token_ids, loss_mask, top, self.device)
        top_ids, top_values = check_top(ids, top_values, token_ids, loss_mask, top, where)
        return ChainScore(check_scores(values, token_ids, loss_mask, where), top_ids, top_values)


def score_with_model(model, token_ids, loss_mask, device=None) -> list[float]:
    """One fp32 prefill pass of a causal LM over `token_ids` (int [T]): log p(token_t | tokens_<t)
    at every position with `loss_mask` 1, 0.0 elsewhere (position 0 has no context: 0.0)."""
    import torch

    from app.training.policy import token_logprobs

    device = device or next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    positions = torch.tensor([i for i, m in enumerate(loss_mask) if m and i > 0], dtype=torch.long, device=device)
    out = [0.0] * len(token_ids)
    if positions.numel() == 0:
        return out
    with torch.no_grad():
        values = token_logprobs(model, ids, torch.ones_like(ids), torch.zeros_like(positions), positions - 1,
                                ids[0, positions]).float().cpu().tolist()
    for p, v in zip(positions.tolist(), values):
        out[p] = v
    return out


def top_with_model(model, token_ids, loss_mask, top: int, device=None, chunk: int = 256):
    """One fp32 prefill pass of a causal LM over `token_ids` (int [T]) giving, at every position
    with `loss_mask` 1 (but 0), log p(token_t | tokens_<t) and the `top` likeliest tokens there
    with their logprobs: (floats [T], ints [T][top], floats [T][top]), zeros elsewhere.  The LM
    head runs `chunk` positions at a time, so no [T, vocab] tensor exists."""
    import torch

    from app.training.policy import causal_lm

    device = device or next(model.parameters()).device
    lm = causal_lm(model)
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    positions = [i for i, m in enumerate(loss_mask) if m and i > 0]
    values = [0.0] * len(token_ids)
    top_ids = [[0] * top for _ in token_ids]
    top_values = [[0.0] * top for _ in token_ids]
    if not positions:
        return values, top_ids, top_values
    with torch.no_grad():
        hidden = lm.model(input_ids=ids, use_cache=False).last_hidden_state[0]
        for start in range(0, len(positions), chunk):
            where = torch.tensor(positions[start:start + chunk], dtype=torch.long, device=device)
            logp = torch.log_softmax(lm.lm_head(hidden[where - 1]).float(), dim=-1)
            chosen = logp.gather(1, ids[0, where].unsqueeze(-1))[:, 0].cpu().tolist()
            best = logp.topk(top, dim=-1)
            for p, v, i, b in zip(where.tolist(), chosen, best.indices.cpu().tolist(), best.values.cpu().tolist()):
                # ties ordered as `parse_prompt_top` orders an engine's: by logprob, then id, descending
                ranked = sorted(zip(b, i), reverse=True)
                values[p], top_ids[p], top_values[p] = v, [x for _, x in ranked], [y for y, _ in ranked]
    return values, top_ids, top_values


class RemoteScorer:
    """Engines serving the teacher: `prompt_logprobs` of a token-id prompt (vLLM's shape:
    `choices[0].prompt_logprobs[t]` maps `str(id)` to `{"logprob", ...}`, None at t = 0)."""

    def __init__(self, teacher: TeacherChoice):
        from app.engines.client import EngineClient

        self.name = teacher.name
        self.clients = [EngineClient(url, timeout=teacher.timeout_s) for url in teacher.engine_urls]
        self.next = 0

    def score(self, token_ids, loss_mask) -> list[float]:
        from app.engines.errors import EngineCallError

        client = self.clients[self.next % len(self.clients)]
        self.next += 1
        body = {"model": self.name, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 0}
        try:
            answer = client.request("POST", "/v1/completions", body)
        except EngineCallError as exc:
            raise TeacherError(f"teacher engine {client.base_url} cannot score: {exc}") from exc
        return check_scores(parse_prompt_logprobs(answer, token_ids, client.base_url), token_ids, loss_mask,
                            f"teacher engine {client.base_url}")

    def score_top(self, token_ids, loss_mask, top: int) -> ChainScore:
        """`score` with `prompt_logprobs: top`, keeping the `top` likeliest tokens per position
        (`ChainScore`).  Raises `TeacherError` as `score`, and when an engine returns fewer."""
        from app.engines.errors import EngineCallError

        client = self.clients[self.next % len(self.clients)]
        self.next += 1
        where = f"teacher engine {client.base_url}"
        body = {"model": self.name, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": top}
        try:
            answer = client.request("POST", "/v1/completions", body)
        except EngineCallError as exc:
            raise TeacherError(f"teacher engine {client.base_url} cannot score: {exc}") from exc
        values = parse_prompt_logprobs(answer, token_ids, client.base_url)
        ids, top_values = parse_prompt_top(answer, token_ids, loss_mask, top, client.base_url)
        ids, top_values = check_top(ids, top_values, token_ids, loss_mask, top, where)
        return ChainScore(check_scores(values, token_ids, loss_mask, where), ids, top_values)


_SCORERS: dict[tuple, object] = {}


def scorer_for(teacher: TeacherChoice):
    """The (process-resident) scorer of `teacher`: remote with `engine_urls`, else local."""
    key = (teacher.name, teacher.checkpoint, tuple(teacher.engine_urls))
    if key not in _SCORERS:
        _SCORERS.clear()  # one teacher resident at a time
        _SCORERS[key] = RemoteScorer(teacher) if teacher.engine_urls else LocalScorer(teacher_spec(teacher))
    return _SCORERS[key]


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
