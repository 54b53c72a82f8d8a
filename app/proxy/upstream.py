"""The gateway's client of the engines (OpenAI Chat Completions + vLLM extensions).

Engines are listed in `get_settings().engine_urls`.  A session's calls always go
to the same engine (rendezvous hashing on the episode id), so the engine's prefix
cache holds the growing conversation; adding an engine moves only 1/n sessions.

Every request asks for `return_token_ids` and `logprobs` (vLLM >= 0.10.2,
PR #22587) so the record holds the engine's own ids.  Engine errors are mapped
to `GatewayError`s; a context overflow caused only by a too-large completion limit
is retried once with the limit clamped to the room left (B38).  The HTTP hop uses the small
keep-alive client in `app.proxy.http11` so the request thread relays tokens itself.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field

from app.config import get_settings
from app.proxy.common import gateway_settings
from app.proxy.errors import GatewayError, context_error, parse_context_overflow
from app.proxy.http11 import HTTPError, Pool, Response
from app.proxy.sse import SSEDecoder

log = logging.getLogger("turnstile.gateway")
DONE = object()   # upstream sent [DONE]
EOF = object()    # upstream closed the stream without [DONE]


@dataclass
class Engine:
    url: str
    model: str | None = None
    max_model_len: int | None = None
    discovered_at: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def id(self) -> str:
        return self.url


def _message_of(status: int, raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")[:2000] or f"HTTP {status}"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if body.get(key):
                return str(body[key])
    return json.dumps(body)[:2000]


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


class StreamHandle:
    """An accepted upstream stream, read by the request thread itself (`poll`)."""

    def __init__(self, resp: Response) -> None:
        self.resp = resp
        self.decoder = SSEDecoder()

    def _parse(self, frames) -> list:
        items: list = []
        for _event, data in frames:
            if data.strip() == "[DONE]":
                items.append(DONE)
                return items
            if data:
                try:
                    items.append(json.loads(data))
                except ValueError as exc:
                    items.append(exc)
                    return items
        return items

    def poll(self, timeout: float) -> list | None:
        """Upstream items available now (chunk dicts, then DONE, EOF or an Exception);
        None when `timeout` passed without data (the caller sends a keep-alive)."""
        try:
            data = self.resp.read_some(timeout)
        except HTTPError as exc:
            return [exc]
        if data is None:
            return None
        if not data:
            items = self._parse(self.decoder.close())
            return items if items and items[-1] is DONE else items + [EOF]
        return self._parse(self.decoder.feed(data))

    def close(self) -> None:
        """Stop reading; closing the connection makes the engine abort the request."""
        self.resp.close()


class PendingStream:
    """A streamed request written to the engine; its response head may still be on the way
    (an engine may say nothing while it prefills)."""

    def __init__(self, resp: Response) -> None:
        self.resp = resp
        self.result: StreamHandle | GatewayError | None = None
        self.t_done: float | None = None

    def wait(self, timeout: float) -> StreamHandle | GatewayError | None:
        """The handle (engine accepted) or the engine's error once known; None until then."""
        if self.result is not None:
            return self.result
        try:
            if not self.resp.head(timeout):
                return None
            if self.resp.status >= 400:
                body = self.resp.read_all()
                self.result = map_engine_error(self.resp.status, _message_of(self.resp.status, body))
            else:
                self.result = StreamHandle(self.resp)
        except HTTPError as exc:
            self.resp.close()
            self.result = GatewayError("upstream", f"The engine stream failed: {exc}")
        self.t_done = time.perf_counter()
        return self.result

    def cancel(self) -> None:
        self.resp.close()


class Upstream:
    """Pool of engines with session-affine routing and keep-alive connections."""

    def __init__(self, urls: list[str] | None = None) -> None:
        urls = urls or get_settings().engine_urls
        self.engines = [Engine(u.rstrip("/")) for u in urls]
        self.pools = {e.url: Pool(e.url) for e in self.engines}
        self.timeout = gateway_settings().upstream_timeout_s

    def pick(self, episode_id: int) -> Engine:
        """Rendezvous (highest-random-weight) hashing: same episode -> same engine."""
        if len(self.engines) == 1:
            return self.engines[0]
        key = str(episode_id).encode()
        return max(self.engines, key=lambda e: hashlib.blake2b(key + e.url.encode(), digest_size=8).digest())

    # --- discovery ---------------------------------------------------------------------

    def describe(self, engine: Engine) -> Engine:
        """Learn the engine's served model name and max_model_len from GET /v1/models (cached 60 s)."""
        if engine.model is not None and time.monotonic() - engine.discovered_at < 60:
            return engine
        with engine.lock:
            if engine.model is not None and time.monotonic() - engine.discovered_at < 60:
                return engine
            data: dict = {}
            try:
                resp = self.pools[engine.url].request("GET", "/v1/models", timeout=5.0)
                resp.head()
                raw = resp.read_all()
                if resp.status == 200:
                    data = (json.loads(raw).get("data") or [{}])[0]
            except (HTTPError, ValueError, AttributeError, IndexError):
                data = {}
            engine.model = data.get("id") or engine.model or "default"
            engine.max_model_len = data.get("max_model_len") or engine.max_model_len
            engine.discovered_at = time.monotonic()
        return engine

    # --- calls ---------------------------------------------------------------------------

    def _send(self, engine: Engine, path: str, body: dict, episode_id: int | None) -> Response:
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        headers = {"Content-Type": "application/json"}
        if episode_id is not None:
            headers["X-Turnstile-Episode"] = str(episode_id)  # not a secret: lets engines group a session
        try:
            return self.pools[engine.url].request("POST", path, data, headers, timeout=self.timeout)
        except HTTPError as exc:
            raise GatewayError("upstream", f"The engine at {engine.url} is unreachable: {exc}") from exc

    def _json_call(self, engine: Engine, path: str, body: dict, episode_id: int | None) -> dict:
        resp = self._send(engine, path, body, episode_id)
        try:
            if not resp.head(self.timeout):
                resp.close()
                raise GatewayError("upstream", f"The engine at {engine.url} timed out")
            raw = resp.read_all()
        except HTTPError as exc:
            resp.close()
            raise GatewayError("upstream", f"The engine at {engine.url} failed: {exc}") from exc
        if resp.status >= 400:
            raise map_engine_error(resp.status, _message_of(resp.status, raw))
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise GatewayError("upstream", "The engine returned invalid JSON") from exc

    @staticmethod
    def _room(engine: Engine, body: dict, err: GatewayError | None) -> int | None:
        """The clamped max_tokens to retry with when an overflow came from max_tokens alone (B38)."""
        if err is None or err.kind != "context_length" or err.prompt_tokens is None or err.max_context is None:
            return None
        room = err.max_context - err.prompt_tokens
        if room < 1 or body.get("max_tokens") is None or body["max_tokens"] <= room:
            return None
        log.info("clamping max_tokens %s -> %s (prompt %s, context %s)", body["max_tokens"], room,
                 err.prompt_tokens, err.max_context)
        return room

    @staticmethod
    def _clamp_to_context(engine: Engine, body: dict) -> None:
        if engine.max_model_len and body.get("max_tokens") and body["max_tokens"] > engine.max_model_len:
            body["max_tokens"] = engine.max_model_len

    def complete(self, engine: Engine, body: dict, episode_id: int | None) -> dict:
        """Non-stream chat completion -> the engine's JSON body (raises GatewayError)."""
        self._clamp_to_context(engine, body)
        try:
            return self._json_call(engine, "/v1/chat/completions", body, episode_id)
        except GatewayError as err:
            room = self._room(engine, body, err)
            if room is None:
                raise
            body["max_tokens"] = room
            return self._json_call(engine, "/v1/chat/completions", body, episode_id)

    def open_stream(self, engine: Engine, body: dict, episode_id: int | None, wait_s: float) -> PendingStream:
        """Send a streamed chat completion; waits up to `wait_s` for the engine to accept it."""
        self._clamp_to_context(engine, body)
        pending = PendingStream(self._send(engine, "/v1/chat/completions", body, episode_id))
        out = pending.wait(wait_s)
        room = self._room(engine, body, out if isinstance(out, GatewayError) else None)
        if room is not None:
            body["max_tokens"] = room
            pending = PendingStream(self._send(engine, "/v1/chat/completions", body, episode_id))
            pending.wait(wait_s)
        return pending

    def tokenize(self, engine: Engine, body: dict) -> dict:
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
