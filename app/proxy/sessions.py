"""Gateway sessions: one random API key per episode, stored only as its sha256.

The harness uses the token as its API key (Bearer, x-api-key, x-goog-api-key or
Gemini's `?key=`).  It is accepted only while the episode is `running`, never forwarded upstream.  Resolutions are cached in-process for
`TURNSTILE_GATEWAY_SESSION_CACHE_S` (default 2 s) to keep the hot path free of
SQL; a finished episode's token therefore stops working within that delay.
"""
from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db import session_scope
from app.engines.lora_format import run_of
from app.tables import Episode, Run, TrainingStep
from app.proxy.settings import gateway_settings

TOKEN_PREFIX = "tsk-"


@dataclass(frozen=True)
class SessionInfo:
    episode_id: int
    run_id: int
    policy_version: int   # the run's current policy version (fallback when the engine reports none)
    splice_history: bool = True  # the run's `splice_history` option (app.proxy.splice)
    attempt: int = 1  # the episode's rollout attempt this token belongs to (a new token per attempt)
    adapter: str | None = None  # a LoRA run's current adapter on the engines (None: the engines' weights)


def hash_token(token: str) -> str:
    """sha256 hex of a session token (what `Episode.session_token_hash` stores)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def issue_session(session: Session, episode_id: int) -> str:
    """Create a fresh token for `episode_id`, store its hash, return the token (shown once).

    Raises LookupError when the episode does not exist.  Re-issuing replaces the old token.
    """
    episode = session.get(Episode, episode_id)
    if episode is None:
        raise LookupError(f"episode {episode_id} does not exist")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    episode.session_token_hash = hash_token(token)
    session.flush()
    return token


# Resolutions trusted for `session_cache_s`; at most MAX_CACHED_SESSIONS of them, oldest
# dropped first, so a long-lived gateway worker's memory does not grow with every episode.
MAX_CACHED_SESSIONS = 4096
_cache: OrderedDict[str, tuple[float, SessionInfo]] = OrderedDict()
_cache_lock = threading.Lock()


def forget(token: str | None) -> None:
    """Drop a cached resolution (all of them when token is None)."""
    with _cache_lock:
        if token is None:
            _cache.clear()
        else:
            _cache.pop(hash_token(token), None)


def resolve_session_info(token: str | None) -> SessionInfo | None:
    """The live session behind `token`, or None (unknown token, or episode not running)."""
    if not token:
        return None
    digest = hash_token(token)
    now = time.monotonic()
    hit = _cache.get(digest)
    if hit is not None and hit[0] > now:
        return hit[1]
    with session_scope() as s:
        row = s.execute(
            select(Episode.id, Episode.run_id, Episode.status, Episode.attempts, Run.policy_version, Run.config)
            .join(Run, Run.id == Episode.run_id)
            .where(Episode.session_token_hash == digest)
        ).first()
    if row is None or row.status != "running":
        with _cache_lock:
            _cache.pop(digest, None)
        return None
    # A LoRA run's adapter and the version its completions are stamped with come from one step
    # row: read apart, a step completing in between would pair a new adapter with the old version.
    served = served_adapter(row.run_id, row.config)
    info = SessionInfo(row.id, row.run_id, served[1] if served else int(row.policy_version or 0),
                       (row.config or {}).get("splice_history", True) is not False,
                       attempt=max(int(row.attempts or 0), 1), adapter=served[0] if served else None)
    with _cache_lock:
        _cache[digest] = (now + gateway_settings().session_cache_s, info)
        _cache.move_to_end(digest)
        while len(_cache) > MAX_CACHED_SESSIONS:
            _cache.popitem(last=False)
    return info


def current_adapter(run_id: int, config: dict | None) -> str | None:
    """The adapter name (`run-<id>@<hash>`) a LoRA train run's newest completed step loaded on the
    engines, or None (not a LoRA run, no step yet: the adapters start as the base model).  A
    held-out eval of a train run (`eval_of`) samples that run's adapter: the policy it measures."""
    served = served_adapter(run_id, config)
    return served[0] if served else None


def served_adapter(run_id: int, config: dict | None) -> tuple[str, int] | None:
    """`(adapter name, policy version)` of the newest completed step of a LoRA train run (or of the
    train run an `eval_of` eval measures), read from that one step row; None as `current_adapter`."""
    config = config or {}
    if config.get("kind") == "eval" and (config.get("eval_of") or {}).get("run") is not None:
        train_id = int(config["eval_of"]["run"])
        with session_scope() as s:
            train_config = s.scalar(select(Run.config).where(Run.id == train_id))
        return served_adapter(train_id, train_config) if (train_config or {}).get("kind") == "train" else None
    if not config.get("training", {}).get("lora") or config.get("kind") != "train":
        return None
    with session_scope() as s:
        row = s.execute(select(TrainingStep.metrics, TrainingStep.policy_version).where(
            TrainingStep.run_id == run_id, TrainingStep.status == "completed")
            .order_by(TrainingStep.step.desc()).limit(1)).first()
    name = (row.metrics or {}).get("adapter") if row is not None else None
    return (name, int(row.policy_version or 0)) if name else None


def adapter_folder(name: str) -> Path | None:
    """The folder adapter `name` (`run-<id>@<hash>`) was loaded from: the `adapter/` folder of the
    checkpoint of the run's completed step that made it; None when no kept checkpoint made it
    (pruned, or not a run's adapter name)."""
    run_id = run_of(name)
    if run_id is None:
        return None
    with session_scope() as s:
        rows = s.execute(select(TrainingStep.metrics, TrainingStep.checkpoint_path).where(
            TrainingStep.run_id == run_id, TrainingStep.status == "completed",
            TrainingStep.checkpoint_path.is_not(None)).order_by(TrainingStep.step.desc())).all()
    for metrics, checkpoint in rows:
        if (metrics or {}).get("adapter") == name and (Path(checkpoint) / "adapter").is_dir():
            return Path(checkpoint) / "adapter"
    return None


def adapter_base(name: str) -> str | None:
    """The starting checkpoint (`Run.start_weights` folder) of the run adapter `name` belongs to:
    the base weights the adapter was trained on and must be served on; None when the run started
    from the engines' own base (or `name` is no run's adapter)."""
    run_id = run_of(name)
    if run_id is None:
        return None
    with session_scope() as s:
        run = s.get(Run, run_id)
        start = run.start_weights() if run is not None else None
    return start[0] if start else None


def resolve_session(token: str | None) -> int | None:
    """The episode id of a live session token, else None."""
    info = resolve_session_info(token)
    return info.episode_id if info else None
