"""One Tinker `sample` future, from its SQL row to its result: what the rollout worker's task runs.

    claim     `pending -> running` under a lease (`app.control.tinker_futures`); a future another
              worker holds, or one already finished, is left alone (a redelivered message)
    resolve   the sampler it may use: its own key's sampling session, model and checkpoint only
              (`app.control.tinker_samplers.resolve`)
    sample    on the engine its sampling session hashes to, under the checkpoint's adapter
              (`app.control.tinker_sampling.sample`); an engine that lost the adapter (restarted
              since it was pushed: 404) loads it from its folder and the request is sent again once
    finish    `complete` with the result, or `fail`: the caller's mistakes with the SDK's `User`
              category (the SDK raises them and does not retry), engine failures with `Server`

Sampling has no side effect on a tenant's state, so a future whose worker died mid-request is
simply answered again by the reaper's re-send (`tinker_futures.reap`).
"""
from __future__ import annotations

import logging
import threading

from app.control import tinker_futures
from app.control.tinker_sampling import SampleError, parse_request, sample
from app.control.tinker_samplers import SamplerTarget, pick_engine, resolve
from app.db import session_scope
from app.engines.client import EngineCallError, EngineClient, EngineHTTPError

log = logging.getLogger(__name__)
LEASE_S = 900.0  # a sample of max_tokens on a CPU engine takes minutes at most
_clients: dict[str, EngineClient] = {}
_bases: dict[str, str | None] = {}
_lock = threading.Lock()


def _client(url: str) -> EngineClient:
    with _lock:
        if url not in _clients:
            _clients[url] = EngineClient(url, timeout=LEASE_S)
        return _clients[url]


def _served_base(url: str, client: EngineClient) -> str | None:
    """The model spec the engine at `url` was started from (`GET /v1/models` `root`), once per process."""
    if url not in _bases:
        models = client.models()
        _bases[url] = str(models[0].get("root")) if models and models[0].get("root") else None
    return _bases[url]


def answer(client: EngineClient, url: str, payload: dict, target: SamplerTarget) -> dict:
    """The sample result of `payload` on `target` from the engine behind `client`.

    Raises `SampleError` for the caller's mistakes (and a base model the engine does not serve),
    `EngineCallError` when the engine fails."""
    job = parse_request(payload)
    served = _served_base(url, client)
    if served is not None and served != target.base_model:
        raise SampleError(f"base model {target.base_model!r} is not the model the engines serve ({served!r})")
    try:
        return sample(client, job, target.adapter)
    except EngineHTTPError as exc:
        if exc.status != 404 or target.adapter is None:
            raise
    # The engine no longer holds the adapter (restarted since the save): load it, ask again once.
    client.load_lora_adapter(target.adapter, str(target.folder))
    return sample(client, job, target.adapter)


def run(future_id: int) -> str:
    """Answer sample future `future_id`; returns what happened: "completed", "failed" or
    "skipped" (another worker holds it, or it is finished)."""
    with session_scope() as s:
        row = tinker_futures.claim(s, future_id, lease_s=LEASE_S)
        if row is None:
            return "skipped"
        attempt, payload = row.attempts, dict(row.payload or {})
        session_key = row.sampling_session_id or row.request_id
        try:
            target = resolve(s, row)
        except SampleError as exc:
            tinker_futures.fail(s, future_id, {"error": str(exc), "category": tinker_futures.USER}, attempt=attempt)
            return "failed"
    url = pick_engine(session_key)
    try:
        result = answer(_client(url), url, payload, target)
    except SampleError as exc:
        error = {"error": str(exc), "category": tinker_futures.USER}
    except EngineCallError as exc:
        log.warning("tinker sample future %s: engine %s failed: %s", future_id, url, exc)
        error = {"error": f"the engine at {url} failed: {exc}", "category": tinker_futures.SERVER}
    else:
        with session_scope() as s:
            done = tinker_futures.complete(s, future_id, result, attempt=attempt)
        return "completed" if done else "skipped"
    with session_scope() as s:
        tinker_futures.fail(s, future_id, error, attempt=attempt)
    return "failed"
