"""The gateway's side of the engines (OpenAI Chat Completions + vLLM extensions).

Engines are listed in `get_settings().engine_urls`.  A session's calls always go
to the same engine (rendezvous hashing on the episode id), so the engine's prefix
cache holds the growing conversation; adding an engine moves only 1/n sessions.

Every request asks for `return_token_ids` and `logprobs` (vLLM >= 0.10.2,
PR #22587) so the record holds the engine's own ids.  EngineTarget errors are mapped
to `GatewayError`s; a context overflow caused only by a too-large completion limit
is retried once with the limit clamped to the room left.  The HTTP hop is the
project's engine client (`app.engines.client.EngineClient`, one per engine, keep-alive
connections).  A non-stream answer is asked of the engine as a non-stream answer and read on
the request thread itself (`complete`), which checks for a departed client while the engine is
silent; a stream is read on the request thread too (`app.engines.stream.ChatStream`, polled
here with a timeout: no reader thread, no hand-off per chunk), so the request thread sends
keep-alives while the engine is silent and a slow client back-pressures the engine.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field

from app.config import get_settings
from app.engines.client import (DONE, EOF, ChatStream, EngineCallError, EngineClient, EngineConnectionError,
                                EngineHTTPError, weights_label)
from app.engines.lora_format import NAME as ADAPTER_NAME
from app.proxy.settings import gateway_settings
from app.proxy.errors import GatewayError, context_error, parse_context_overflow

log = logging.getLogger("turnstile.gateway")
__all__ = ["DONE", "EOF", "EngineTarget", "PendingStream", "StreamHandle", "Upstream", "get_upstream",
           "map_engine_error", "reset_upstream"]


@dataclass
class EngineTarget:
    url: str
    model: str | None = None
    max_model_len: int | None = None
    # Its model card's `route_shape` ([layers, top_k, experts] of an MoE model, null for a dense
    # one: the embedded engine's); None when the card does not say (vLLM's).
    moe: bool | None = None
    discovered_at: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def id(self) -> str:
        return self.url

    @property
    def asks_routes(self) -> bool:
        """Whether calls ask this engine for `return_routed_experts`: unless its card says the
        model is dense, so a dense embedded engine is never asked.  An engine whose card does not
        say (vLLM) is asked: vLLM ignores the field and returns routes only when its server was
        started with `--enable-return-routed-experts` (`app.engines.routed`), which costs a dense
        model nothing."""
        return self.moe is not False


def map_engine_error(status: int, message: str) -> GatewayError:
    """An engine HTTP error -> the GatewayError the client should see (never an empty 400)."""
    overflow = parse_context_overflow(message)
    if status in (400, 413, 422) and overflow is not None:
        return context_error(*overflow)
    if 400 <= status < 500 and status not in (404, 408, 429):
        return GatewayError("invalid_request", f"The engine rejected the request: {message}")
    if status == 429 or status == 503:
        return GatewayError("overloaded", f"The engine is overloaded: {message}")
    return GatewayError("upstream", f"The engine failed (HTTP {status}): {message}")


def gateway_error(exc: EngineCallError, url: str) -> GatewayError:
    """An engine client error -> GatewayError (HTTP answers mapped, transport failures -> upstream)."""
    if isinstance(exc, EngineHTTPError):
        return map_engine_error(exc.status, exc.message)
    if isinstance(exc, EngineConnectionError) and exc.timed_out:
        return GatewayError("upstream", f"The engine at {url} timed out")
    return GatewayError("upstream", f"The engine at {url} failed: {exc}")


class StreamHandle:
    """An accepted upstream stream, polled by the request thread."""

    def __init__(self, stream: ChatStream) -> None:
        self.stream = stream

    def poll(self, timeout: float) -> list | None:
        """Upstream items available now (chunk dicts, then DONE, EOF or an Exception);
        None when `timeout` passed without data (the caller sends a keep-alive)."""
        return self.stream.poll(timeout)

    def close(self) -> None:
        """Stop reading; an unfinished answer's connection is shut so the engine aborts it."""
        self.stream.close()


class PendingStream:
    """A streamed request sent to the engine; its response head may still be on the way
    (an engine may say nothing while it prefills)."""

    def __init__(self, stream: ChatStream) -> None:
        self.stream = stream
        self.result: StreamHandle | GatewayError | None = None
        self.t_done: float | None = None

    def wait(self, timeout: float) -> StreamHandle | GatewayError | None:
        """The handle (engine accepted) or the engine's error once known; None until then."""
        if self.result is not None:
            return self.result
        if not self.stream.wait(timeout):
            return None
        error = self.stream.error
        if error is None:
            self.result = StreamHandle(self.stream)
        elif isinstance(error, EngineHTTPError):
            self.result = map_engine_error(error.status, error.message)
        else:
            self.result = GatewayError("upstream", f"The engine stream failed: {error}")
        self.t_done = time.perf_counter()
        return self.result

    def cancel(self) -> None:
        self.stream.close()


class Upstream:
    """Pool of engines with session-affine routing and keep-alive connections."""

    def __init__(self, urls: list[str] | None = None) -> None:
        urls = urls or get_settings().engine_urls
        self.engines = [EngineTarget(u.rstrip("/")) for u in urls]
        self.timeout = gateway_settings().upstream_timeout_s
        self.clients = {e.url: EngineClient(e.url, timeout=self.timeout, max_keepalive=256) for e in self.engines}
        self._adapter_locks: dict[tuple[str, str], threading.Lock] = {}

    def pick(self, episode_id: int) -> EngineTarget:
        """Rendezvous (highest-random-weight) hashing: same episode -> same engine."""
        if len(self.engines) == 1:
            return self.engines[0]
        key = str(episode_id).encode()
        return max(self.engines, key=lambda e: hashlib.blake2b(key + e.url.encode(), digest_size=8).digest())

    # --- discovery ---------------------------------------------------------------------

    def describe(self, engine: EngineTarget) -> EngineTarget:
        """Learn the engine's served model name, max_model_len and whether it serves an MoE model
        (`moe`) from GET /v1/models (cached 60 s)."""
        if engine.model is not None and time.monotonic() - engine.discovered_at < 60:
            return engine
        with engine.lock:
            if engine.model is not None and time.monotonic() - engine.discovered_at < 60:
                return engine
            try:
                data = (self.clients[engine.url].models(timeout=5.0) or [{}])[0]
            except EngineCallError:
                data = {}
            engine.model = data.get("id") or engine.model or "default"
            engine.max_model_len = data.get("max_model_len") or engine.max_model_len
            if "route_shape" in data:
                engine.moe = data["route_shape"] is not None
            engine.discovered_at = time.monotonic()
        return engine

    # --- calls ---------------------------------------------------------------------------

    @staticmethod
    def _headers(episode_id: int | None) -> dict:
        # Not a secret: lets engines group a session's calls.
        return {} if episode_id is None else {"X-Turnstile-Episode": str(episode_id)}

    def _json_call(self, engine: EngineTarget, path: str, body: dict, episode_id: int | None) -> dict:
        try:
            answer = self.clients[engine.url].request("POST", path, body, headers=self._headers(episode_id))
        except EngineCallError as exc:
            raise gateway_error(exc, engine.url) from exc
        if not isinstance(answer, dict):
            raise GatewayError("upstream", "The engine returned invalid JSON")
        return answer

    @staticmethod
    def _room(engine: EngineTarget, body: dict, err: GatewayError | None) -> int | None:
        """The clamped max_tokens to retry with when an overflow came from max_tokens alone."""
        if err is None or err.kind != "context_length" or err.prompt_tokens is None or err.max_context is None:
            return None
        room = err.max_context - err.prompt_tokens
        if room < 1 or body.get("max_tokens") is None or body["max_tokens"] <= room:
            return None
        log.info("clamping max_tokens %s -> %s (prompt %s, context %s)", body["max_tokens"], room,
                 err.prompt_tokens, err.max_context)
        return room

    @staticmethod
    def _clamp_to_context(engine: EngineTarget, body: dict) -> None:
        if engine.max_model_len and body.get("max_tokens") and body["max_tokens"] > engine.max_model_len:
            body["max_tokens"] = engine.max_model_len

    def _restore_adapter(self, engine: EngineTarget, body: dict, exc: BaseException | None) -> bool:
        """After the engine answered 404 for the LoRA adapter the body names (an engine restarted,
        or one that unloaded the version a session still samples), load it again from its
        checkpoint folder (`sessions.adapter_folder`); whether it is served now, so the call can be
        sent again.  Concurrent calls for one adapter load it one at a time (loading a name already
        served again is a no-op on both engines)."""
        name = body.get("model")
        if not (isinstance(exc, EngineHTTPError) and exc.status == 404 and isinstance(name, str)
                and ADAPTER_NAME.match(name)):
            return False
        from app.proxy.sessions import adapter_base, adapter_folder

        with self._adapter_locks.setdefault((engine.url, name), threading.Lock()):
            folder = adapter_folder(name)
            if folder is None:
                log.warning("engine %s lost adapter %s and no kept checkpoint made it", engine.url, name)
                return False
            base = adapter_base(name)
            if base is not None and not self._serves_base(engine, base):
                # A restarted engine serves its own base, not the checkpoint the run started from;
                # the adapter on it would answer as the run's policy without being it.  The
                # watchdog loads the run's base and then the adapter (`app.control.engine_resync`).
                log.error("engine %s lost adapter %s and does not serve its base %s: not loading it", engine.url,
                          name, base)
                return False
            try:
                self.clients[engine.url].load_lora_adapter(name, str(folder), timeout=120.0)
            except EngineCallError as load_error:
                log.error("engine %s lost adapter %s and did not load it again: %s", engine.url, name, load_error)
                return False
        log.warning("engine %s lost adapter %s; loaded it again from %s", engine.url, name, folder)
        return True

    def _serves_base(self, engine: EngineTarget, base: str) -> bool:
        """False only when the engine names other weights than `base` (a model folder) as what it
        serves.  An engine that names none (vLLM has no `/v1/policy_version`) or cannot be asked
        cannot be checked here: the adapter load that follows goes ahead (and fails where the
        engine is down)."""
        try:
            _version, weights = self.clients[engine.url].serving()
        except (EngineCallError, ValueError):
            return True
        return weights is None or weights == weights_label(base)

    def complete(self, engine: EngineTarget, body: dict, episode_id: int | None, idle=None, idle_s: float = 0.25) -> dict:
        """Non-stream chat completion -> the engine's JSON body.  ``idle()`` runs every ``idle_s``
        seconds while the engine is silent; what it raises ends the call, closing the engine
        request (`EngineClient.complete`).  An overflow caused by max_tokens alone is retried once
        with the room left; a LoRA adapter the engine no longer serves is loaded again and the call
        sent again once (`_restore_adapter`).

        Raises:
            GatewayError: the engine refused the request, could not be reached, or did not
                answer a JSON object.
        """
        self._clamp_to_context(engine, body)
        client = self.clients[engine.url]
        for attempt in (1, 2):
            try:
                answer = client.complete(body, headers=self._headers(episode_id), idle=idle, idle_s=idle_s)
            except EngineCallError as exc:
                if attempt == 1 and self._restore_adapter(engine, body, exc):
                    continue
                err = gateway_error(exc, engine.url)
                room = self._room(engine, body, err) if attempt == 1 else None
                if room is None:
                    raise err from exc
                body["max_tokens"] = room
                continue
            if not isinstance(answer, dict):
                raise GatewayError("upstream", "The engine returned invalid JSON")
            return answer
        raise AssertionError("unreachable")

    def _start(self, engine: EngineTarget, body: dict, episode_id: int | None) -> PendingStream:
        return PendingStream(self.clients[engine.url].open_stream(body, headers=self._headers(episode_id)))

    def open_stream(self, engine: EngineTarget, body: dict, episode_id: int | None, wait_s: float) -> PendingStream:
        """Send a streamed chat completion; waits up to `wait_s` for the engine to accept it.  A
        LoRA adapter the engine no longer serves is loaded again and the request sent again once."""
        self._clamp_to_context(engine, body)
        pending = self._start(engine, body, episode_id)
        out = pending.wait(wait_s)
        if isinstance(out, GatewayError) and self._restore_adapter(engine, body, pending.stream.error):
            pending = self._start(engine, body, episode_id)
            out = pending.wait(wait_s)
        room = self._room(engine, body, out if isinstance(out, GatewayError) else None)
        if room is not None:
            body["max_tokens"] = room
            pending = self._start(engine, body, episode_id)
            pending.wait(wait_s)
        return pending

    def tokenize(self, engine: EngineTarget, body: dict) -> dict:
        """vLLM POST /tokenize (messages form) -> {count, max_model_len, tokens}."""
        return self._json_call(engine, "/tokenize", body, None)


_upstream: Upstream | None = None
_lock = threading.Lock()


def get_upstream() -> Upstream:
    global _upstream
    if _upstream is None:
        with _lock:
            if _upstream is None:
                _upstream = Upstream()
    return _upstream


def reset_upstream() -> None:
    global _upstream
    _upstream = None
