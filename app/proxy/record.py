"""Capture: one `Completion` row per model call through the gateway.

The row holds what the policy saw and sampled (prompt ids, sampled ids, per-token
logprobs from the engine, never re-tokenized), the raw client request with auth
headers removed, the internal request sent upstream, the client-facing response,
the finish reason, engine id, policy version and timings (and, in `normalized_request`, the
sampling transform the tokens were drawn under: `app.proxy.sampling`), and for an MoE policy
the engine's routed experts (`routed_experts` bytes, `route_shape`: `_routes`):

  queue_ms        request arrival -> engine accepted the request (response headers)
  first_token_ms  request arrival -> first generated token from the engine
  total_ms        request arrival -> end of the answer (or disconnect)

(A non-stream call is answered by the engine in one piece, so its queue_ms and first_token_ms
are None: only streamed calls tell when the engine accepted and when it sampled the first token.)

One row per call, and one per try only when it is a true retry.  SDKs retry a call
whose answer failed (openai-python and anthropic-sdk-python retry connection errors,
timeouts, 408/409/429 and 5xx, twice by default:
https://github.com/openai/openai-python#retries), so a call is identified by
`request_key` = sha256(episode, path, body, Idempotency-Key) within its rollout
`attempt` (the session token of one attempt).  The rule that tells a retry from a
deliberate repeat of the same body:

  * an answer that reached the client whole (`partial` False) always keeps its own row:
    a harness that sends the same request again after reading that answer is making a
    new call, and both are trained;
  * an answer that did not (`partial`: the client left, or the engine failed mid-answer)
    is a dead try: the next try of the same key replaces its row in place, keeping its
    `seq` (the harness continues from the answer it finally received), and a dead try that
    arrived before a stored row of its key is dropped.

Rows of different attempts never meet: attempt 2's first call never replaces attempt 1's
row, whatever its key.  Writers of one episode are serialised by a row lock on the episode
(an UPDATE of the row, which takes SQLite's write lock and PostgreSQL's row lock), so the
decision above and the `seq` allocation (max+1 within the episode) never race.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import bindparam, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from app import versions, weight_gate
from app.db import get_engine, session_scope
from app.engines.route_bytes import to_bytes
from app.tables import Completion, Episode
from app.proxy import limits, sampling
from app.proxy.canonical import Result
from app.proxy.errors import GatewayError

log = logging.getLogger("turnstile.gateway")
# Engine-request fields that carry the spliced prompt ids (`app.proxy.splice`); not recorded.
SPLICED_FIELDS = ("prompt_token_ids", "kv_transfer_params")
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
_E = Episode.__table__
# Built once (compiled once): one statement allocates the next seq and inserts.
_INSERT = insert(_T).values(seq=select(func.coalesce(func.max(_T.c.seq), -1) + 1)
                            .where(_T.c.episode_id == bindparam("seq_episode")).scalar_subquery()
                            ).returning(_T.c.id)
# The stored tries of one call (built once: building and hashing the statement per call cost
# about as much CPU as running it).  Not ordered in SQL: with ORDER BY seq, SQLite's planner
# walks the (episode_id, seq) unique index to skip the sort and reads every completion of the
# episode instead of looking the key up in ix_completion_request_key (measured: 1.5 ms per call
# at 1,500 completions in one episode); the few tries are sorted here.
_TRIES = select(_T.c.id, _T.c.seq, _T.c.partial, _T.c.raw_request["received_at"].as_float().label("received_at")
                ).where(_T.c.episode_id == bindparam("try_episode"), _T.c.attempt == bindparam("try_attempt"),
                        _T.c.request_key == bindparam("try_key"))
# Takes the episode row's write lock for the transaction (changes nothing).
_LOCK_EPISODE = update(_E).where(_E.c.id == bindparam("lock_episode")).values(updated_at=_E.c.updated_at)


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
    # Stamp tokens from the engine's recorded weight updates when it reports no versions (vLLM),
    # for calls on the full weights; an adapter's version is its step's, whatever the base does.
    stamp_from_updates: bool = True
    attempt: int = 1  # the episode's rollout attempt whose session token the call used
    t0: float = field(default_factory=time.perf_counter)
    t_accepted: float | None = None
    t_accepted_wall: float | None = None  # time.time() of the same moment (versions of vLLM answers)
    t_first: float | None = None
    written: bool = False

    def ms(self, t: float | None) -> float | None:
        return None if t is None else round((t - self.t0) * 1000.0, 3)

    def accepted(self, t_accepted: float | None) -> None:
        """The engine accepted the request (at `t_accepted`, perf_counter; None for a non-stream
        answer, whose head came with the whole answer): stamp the time and keep a copy of the
        engine request as sent, without the spliced prompt ids (the engine's own prompt ids are
        recorded as `prompt_ids`).

        Until now `normalized_request` is the very body sent, so the record shows what the engine
        client changed in place before sending (`max_tokens` clamped to the context); from now
        on the record and the wire body are separate objects.
        """
        self.t_accepted = t_accepted
        self.t_accepted_wall = time.time()
        self.normalized_request = {k: v for k, v in self.normalized_request.items() if k not in SPLICED_FIELDS}


def write_completion(cap: Capture, result: Result, response: dict | None, response_id: str | None, *,
                     partial: bool, error: str | None = None) -> int | None:
    """Insert the completion row, or replace the dead try it retries (module docstring); returns its id.

    `partial`: the answer did not reach the client whole.  Safe to call once per capture:
    later calls are ignored.  Database errors are logged and re-raised to the caller.
    """
    if cap.written:
        return None
    cap.written = True
    routes = _routes(result)  # before the flags are copied: it may add one
    normalized = dict(cap.normalized_request)
    if result.flags:
        normalized["turnstile_flags"] = list(result.flags)
    drawn_under = sampling.sampling_record(cap.normalized_request, result.logprobs_content, len(result.sampled_ids))
    if drawn_under is not None:  # the transform the tokens were drawn under: `app.proxy.sampling`
        normalized["turnstile_sampling"] = drawn_under
    if result.withheld_calls:  # sampled (in sampled_ids) but not shown: `canonical.withhold_calls`
        normalized["turnstile_withheld_tool_calls"] = [
            {"id": t.id, "name": t.name, "arguments": t.arguments} for t in result.withheld_calls]
    values = dict(
        api=cap.api, model=cap.model, stream=cap.stream, raw_request=cap.raw_request,
        normalized_request=normalized, response=response, response_id=response_id,
        prompt_ids=result.prompt_ids, sampled_ids=list(result.sampled_ids), logprobs=list(result.logprobs),
        finish_reason=result.sampled_finish_reason if result.withheld_calls else result.finish_reason,
        engine_id=cap.engine_id,
        **_versions(result, cap), **routes,
        queue_ms=cap.ms(cap.t_accepted), first_token_ms=cap.ms(cap.t_first), total_ms=cap.ms(time.perf_counter()),
        partial=partial, error=error,
    )
    received = float(cap.raw_request.get("received_at") or 0.0)
    for attempt in range(50):
        try:
            with get_engine().begin() as conn:
                conn.execute(_LOCK_EPISODE, {"lock_episode": cap.episode_id})
                target, keep = _retried_row(conn, cap, received, partial)
                if keep:
                    return target  # a later try of this call is already stored
                if target is not None:
                    conn.execute(update(_T).where(_T.c.id == target).values(**values))
                    return target
                return conn.execute(_INSERT, {**values, "request_key": cap.request_key, "episode_id": cap.episode_id,
                                              "attempt": cap.attempt, "seq_episode": cap.episode_id}).scalar_one()
        except IntegrityError:
            time.sleep(0.001 * (attempt + 1))  # a seq taken by a writer that did not lock (cannot happen here)
    raise RuntimeError(f"could not allocate a completion seq for episode {cap.episode_id}")


def _routes(result: Result) -> dict:
    """The completion's `routed_experts` (`app.engines.route_bytes.to_bytes`, int16 LE
    `[P + S - 1, layers, top_k]`) and `route_shape` `[layers, top_k]`; both None when the engine
    sent no routes (a dense model), and when they do not cover exactly the prompt and every
    sampled token but the last (flagged `routed_experts_length_mismatch`: a completion is never
    stored with routes of other tokens).  Always both keys, so a retry that replaces a dead
    try's row never keeps the dead try's routes."""
    routes = result.routed_experts
    if routes is None:
        return {"routed_experts": None, "route_shape": None}
    expected = len(result.prompt_ids or ()) + len(result.sampled_ids) - 1
    if result.prompt_ids is None or not result.sampled_ids or len(routes) != expected:
        log.warning("engine routes cover %d tokens, the completion %d: not recorded", len(routes), expected)
        result.flags.append("routed_experts_length_mismatch")
        return {"routed_experts": None, "route_shape": None}
    return {"routed_experts": to_bytes(routes), "route_shape": [int(n) for n in routes.shape[1:]]}


def _versions(result: Result, cap: Capture) -> dict:
    """The completion's version columns: `policy_version` (its first token's), `policy_versions`
    and `kv_versions` (runs, `app.versions`).

    From the engine's own per-token stamps where they fit the sampled tokens (the embedded
    engine); else, for an engine that stamps none (vLLM), from when each chunk arrived and the
    pauses its reloader recorded (`app.versions.from_arrivals`; a non-stream answer counts as
    arriving when the engine accepted it, so it carries the version it started on, the oldest).
    A malformed report is dropped, never trained on as per-token truth."""
    n, fallback = len(result.sampled_ids), cap.policy_version_fallback
    runs = result.policy_versions if versions.valid(result.policy_versions, n) else None
    kv = result.kv_versions if runs and versions.valid(result.kv_versions, n) else None
    if runs is None and n and cap.stamp_from_updates and cap.engine_id and not result.policy_versions:
        updates = weight_gate.recorded_updates(cap.engine_id)
        if updates:
            started = cap.t_accepted_wall if cap.t_accepted_wall is not None else time.time()
            runs = versions.from_arrivals(result.arrivals or [(0, started)], n, updates, fallback)
    first = runs[0][1] if runs else result.policy_version
    return {"policy_version": first if first is not None else fallback, "policy_versions": runs, "kv_versions": kv}


def _retried_row(conn, cap: Capture, received: float, partial: bool) -> tuple[int | None, bool]:
    """(row id, keep it) for a new try of `cap.request_key` in its attempt: (id, False) = replace
    that dead try, (id, True) = this try is dead and a later one is stored, (None, False) = insert."""
    rows = conn.execute(_TRIES, {"try_episode": cap.episode_id, "try_attempt": cap.attempt,
                                 "try_key": cap.request_key}).all()
    rows.sort(key=lambda r: r.seq)
    if partial:
        later = [r for r in rows if (r.received_at or 0.0) > received]
        if later:
            return later[-1].id, True
    dead = [r for r in rows if r.partial and (r.received_at or 0.0) <= received]
    return (dead[-1].id, False) if dead else (None, False)


def find_response(episode_id: int, response_id: str) -> tuple[dict, dict] | None:
    """(raw request body, client-facing response) of a stored Responses answer of this episode."""
    with session_scope() as s:
        row = s.execute(select(Completion.raw_request, Completion.response)
                        .where(Completion.episode_id == episode_id, Completion.response_id == response_id)
                        .order_by(Completion.id.desc())).first()
    if row is None or row.response is None:
        return None
    return (row.raw_request or {}).get("body") or {}, row.response


def response_history(episode_id: int, response_id: str, limit: int | None = None, max_depth: int = 500) -> list:
    """Input items that `previous_response_id` stands for: the whole chain of earlier inputs and
    outputs, oldest first (OpenAI semantics; instructions are not carried over).

    `limit`: the most bytes (compact JSON) the items may add up to; the chain is read newest first
    and stops as soon as it is past the limit, so a short request naming a long chain never
    holds more than that in memory.

    Raises:
        LookupError: a response id is unknown in this episode, or the chain is longer than `max_depth`.
        GatewayError: too_large (413) when the items exceed `limit`.
    """
    steps: list[list] = []  # newest first
    size, rid = 0, response_id
    while rid is not None:
        if len(steps) >= max_depth:
            raise LookupError("previous_response_id chain is too long")
        found = find_response(episode_id, rid)
        if found is None:
            raise LookupError(rid)
        body, response = found
        inp = body.get("input")
        step = ([{"role": "user", "content": inp}] if isinstance(inp, str) else list(inp or []))
        step += list(response.get("output") or [])
        if limit is not None:
            size += limits.json_size(step)
            if size > limit:
                raise GatewayError("too_large", f"previous_response_id: the history it names exceeds {limit} bytes "
                                                f"(TURNSTILE_GATEWAY_MAX_PROMPT_BYTES)", param="previous_response_id")
        steps.append(step)
        prev = body.get("previous_response_id")
        rid = prev if isinstance(prev, str) else None
    return [item for step in reversed(steps) for item in step]
