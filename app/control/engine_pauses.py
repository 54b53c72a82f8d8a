"""Resume vLLM engines left paused by a weight update that did not finish (a watchdog duty).

`VLLMReloader.reload` records each pause in Redis before it asks for it and forgets the record
once `/resume` answered (`app.weight_gate.record_pause` / `clear_pause`); it resumes the server
itself when the load fails or passes `weight_pause_timeout_s`.  A record older than that
timeout therefore means nobody will resume the server: the trainer process was killed between
the pause and the resume, or its `/resume` failed.  Every watchdog pass sends `POST /resume` to
each such server and forgets the record once it answered (only if it is still the same record:
a newer update's pause is left to its own reloader).  A server that cannot be reached keeps its
record and is tried again at the next pass.

`/resume` on a server that is not paused is a no-op in vLLM (`resume_generation` clears the
pause flag), so a record whose pause never happened costs one call.
"""
from __future__ import annotations

import logging
import time

from app import weight_gate
from app.config import get_settings
from app.engines.client import EngineCallError, EngineClient

log = logging.getLogger("turnstile.watchdog")

RESUME_TIMEOUT_S = 30.0


def resume_stale_pauses(timeout_s: float | None = None, now: float | None = None) -> dict[str, str]:
    """`POST /resume` to every engine whose recorded pause began more than `timeout_s` seconds
    (default: the `weight_pause_timeout_s` setting) before `now` (wall-clock seconds, default the
    current time); returns `{url: "resumed" | "error: …"}` for those engines only.

    Raises `redis.RedisError` when the records cannot be read (the pass reports it)."""
    limit = get_settings().weight_pause_timeout_s if timeout_s is None else timeout_s
    now = time.time() if now is None else now
    results: dict[str, str] = {}
    for url, (version, paused_at, record) in weight_gate.recorded_pauses().items():
        if now - paused_at <= limit:
            continue  # its reloader is within its deadline and resumes the server itself
        try:
            with EngineClient(url, timeout=RESUME_TIMEOUT_S) as client:
                client.request("POST", "/resume")
        except EngineCallError as exc:
            results[url] = f"error: {type(exc).__name__}: {exc}"[:500]
            log.error("event=engine_resume_failed engine=%s paused_for_s=%.0f policy_version=%s error=%s", url,
                      now - paused_at, version, exc)
            continue
        weight_gate.clear_pause(url, record)
        results[url] = "resumed"
        log.warning("event=engine_resumed engine=%s paused_for_s=%.0f policy_version=%s (its weight update never "
                    "resumed it)", url, now - paused_at, version)
    return results
