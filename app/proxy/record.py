"""Capture: one `Completion` row per model call through the gateway.

The row holds what the policy saw and sampled (prompt ids, sampled ids, per-token
logprobs from the engine, never re-tokenized), the raw client request with auth
headers removed, the internal request sent upstream, the client-facing response,
the finish reason, engine id, policy version and timings:

  queue_ms        request arrival -> engine accepted the request (response headers)
  first_token_ms  request arrival -> first generated token from the engine
  total_ms        request arrival -> end of the answer (or disconnect)

Exactly one row per call: SDKs retry the same body (openai/anthropic SDKs retry
twice on 5xx/timeouts), so rows are keyed by `request_key` = sha256(episode,
path, body, Idempotency-Key).  The latest attempt (by arrival time,
`raw_request.received_at`) replaces earlier ones in place (keeping their `seq`),
because the harness continues from the answer it finally received; a slow earlier
attempt that finishes last does not overwrite it.  `seq` (order within the episode) is allocated as max+1 and retried on
a unique-constraint race, so concurrent calls of one episode never collide.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import bindparam, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from app.db import get_engine, session_scope
from app.models import Completion
from app.proxy.canonical import Result

log = logging.getLogger("turnstile.gateway")
SECRET_HEADERS = {"authorization", "x-api-key", "x-goog-api-key", "api-key", "cookie", "proxy-authorization"}


def scrub_headers(headers: Any) -> dict:
    """Request headers without credentials (session tokens never reach the database)."""
    return {k: ("<redacted>" if k.lower() in SECRET_HEADERS else v) for k, v in headers.items()}


def scrub_query(args: Any) -> dict:
    return {k: ("<redacted>" if k.lower() == "key" else v) for k, v in args.items()}


def request_key(episode_id: int, path: str, body: bytes, idempotency_key: str | None) -> str:
    """Identity of one logical call: equal for SDK retries (same body), different otherwise."""
    h = hashlib.sha256()
    h.update(f"{episode_id}\0{path}\0{idempotency_key or ''}\0".encode())
    h.update(body)
    return h.hexdigest()


_T = Completion.__table__
# Built once (compiled once): one statement allocates the next seq and inserts.  SQLite
# serializes writers; on PostgreSQL a concurrent insert may take the same seq -> unique
# violation -> retry.
_INSERT = insert(_T).values(seq=select(func.coalesce(func.max(_T.c.seq), -1) + 1)
                            .where(_T.c.episode_id == bindparam("seq_episode")).scalar_subquery()
                            ).returning(_T.c.id)


@dataclass
class Capture:
    """What the gateway learned about one call while serving it."""

    episode_id: int
    api: str
    model: str
    stream: bool
    request_key: str
    raw_request: dict
    normalized_request: dict
    policy_version_fallback: int
    engine_id: str | None = None
    t0: float = field(default_factory=time.perf_counter)
    t_accepted: float | None = None
    t_first: float | None = None
    written: bool = False

    def ms(self, t: float | None) -> float | None:
        return None if t is None else round((t - self.t0) * 1000.0, 3)


def write_completion(cap: Capture, result: Result, response: dict | None, response_id: str | None, *,
                     partial: bool, error: str | None = None) -> int | None:
    """Insert (or, for a retried request key, overwrite) the completion row; returns its id.

    Safe to call once per capture: later calls are ignored.  Database errors are logged and
    re-raised to the caller.
    """
    if cap.written:
        return None
    cap.written = True
    normalized = dict(cap.normalized_request)
    if result.flags:
        normalized["turnstile_flags"] = list(result.flags)
    values = dict(
        api=cap.api, model=cap.model, stream=cap.stream, raw_request=cap.raw_request,
        normalized_request=normalized, response=response, response_id=response_id,
        prompt_ids=result.prompt_ids, sampled_ids=list(result.sampled_ids), logprobs=list(result.logprobs),
        finish_reason=result.finish_reason, engine_id=cap.engine_id,
        policy_version=result.policy_version if result.policy_version is not None else cap.policy_version_fallback,
        queue_ms=cap.ms(cap.t_accepted), first_token_ms=cap.ms(cap.t_first), total_ms=cap.ms(time.perf_counter()),
        partial=partial, error=error,
    )
    values["request_key"] = cap.request_key
    values["episode_id"] = cap.episode_id
    params = {**values, "seq_episode": cap.episode_id}
    for attempt in range(50):
        try:
            with get_engine().begin() as conn:
                return conn.execute(_INSERT, params).scalar_one()
        except IntegrityError:
            pass
        with get_engine().begin() as conn:  # the key exists (a retried call) or the seq was taken
            existing = conn.execute(select(_T.c.id, _T.c.raw_request).where(
                _T.c.episode_id == cap.episode_id, _T.c.request_key == cap.request_key)).first()
            if existing is not None:
                if (existing.raw_request or {}).get("received_at", 0) > cap.raw_request.get("received_at", 0):
                    return existing.id  # a later attempt (the one the client used) is already stored
                fields = {k: v for k, v in values.items() if k not in ("request_key", "episode_id")}
                conn.execute(update(_T).where(_T.c.id == existing.id).values(**fields))
                return existing.id
        time.sleep(0.001 * (attempt + 1))
    raise RuntimeError(f"could not allocate a completion seq for episode {cap.episode_id}")


def find_response(episode_id: int, response_id: str) -> tuple[dict, dict] | None:
    """(raw request body, client-facing response) of a stored Responses answer of this episode."""
    with session_scope() as s:
        row = s.execute(select(Completion.raw_request, Completion.response)
                        .where(Completion.episode_id == episode_id, Completion.response_id == response_id)
                        .order_by(Completion.id.desc())).first()
    if row is None or row.response is None:
        return None
    return (row.raw_request or {}).get("body") or {}, row.response


def response_history(episode_id: int, response_id: str, depth: int = 0) -> list:
    """Input items that `previous_response_id` stands for: the whole chain of earlier inputs and
    outputs, oldest first (OpenAI semantics; instructions are not carried over).

    Raises LookupError when a response id is unknown in this episode.
    """
    if depth > 500:
        raise LookupError("previous_response_id chain is too long")
    found = find_response(episode_id, response_id)
    if found is None:
        raise LookupError(response_id)
    body, response = found
    items: list = []
    if isinstance(body.get("previous_response_id"), str):
        items += response_history(episode_id, body["previous_response_id"], depth + 1)
    inp = body.get("input")
    items += [{"role": "user", "content": inp}] if isinstance(inp, str) else list(inp or [])
    items += list(response.get("output") or [])
    return items
