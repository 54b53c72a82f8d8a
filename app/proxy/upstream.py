"""The gateway's client of the engines (OpenAI Chat Completions + vLLM extensions).

Engines are listed in `get_settings().engine_urls`.  A session's calls always go
to the same engine (rendezvous hashing on the episode id), so the engine's prefix
cache holds the growing conversation; adding an engine moves only 1/n sessions.

Every request asks for `return_token_ids` and `logprobs` (vLLM >= 0.10.2,
PR #22587) so the record holds the engine's own ids.  Engine errors are mapped
to `GatewayError`s; a context overflow caused only by a too-large completion limit
is retried once with the limit clamped to the room left (B38).
"""
from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import httpx

from app.config import get_settings
from app.proxy.common import gateway_settings
from app.proxy.errors import GatewayError, context_error, parse_context_overflow
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


def _message_of(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:2000] or f"HTTP {resp.status_code}"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("message"):
            return str(body["message"])
        if body.get("detail"):
            return str(body["detail"])
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
    """An open upstream stream; a reader thread parses SSE into `queue` (JSON dicts, DONE, EOF
    or an Exception), so the writer can send keep-alives while the engine prefills."""

    def __init__(self, resp: httpx.Response) -> None:
        self.resp = resp
        self.queue: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._pump, name="upstream-reader", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        dec = SSEDecoder()
        try:
            for raw in self.resp.iter_raw():
                for _event, data in dec.feed(raw):
                    if data.strip() == "[DONE]":
                        self.queue.put(DONE)
                        return
                    if data:
                        self.queue.put(json.loads(data))
            for _event, data in dec.close():
                if data.strip() == "[DONE]":
                    self.queue.put(DONE)
                    return
            self.queue.put(EOF)
        except Exception as exc:  # noqa: BLE001 - handed to the writer, which ends the stream
            self.queue.put(exc if not self._closed else EOF)

    def close(self) -> None:
        """Stop reading; closing the connection makes the engine abort the request."""
        self._closed = True
        try:
            self.resp.close()
        except Exception:  # noqa: BLE001
            pass


class Upstream:
    """Pool of engines with session-affine routing and one shared HTTP client."""

    def __init__(self, urls: list[str] | None = None) -> None:
        urls = urls or get_settings().engine_urls
        self.engines = [Engine(u.rstrip("/")) for u in urls]
        gs = gateway_settings()
        self.client = httpx.Client(
            timeout=httpx.Timeout(connect=5.0, read=gs.upstream_timeout_s, write=60.0, pool=60.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
        )

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
            try:
                resp = self.client.get(f"{engine.url}/v1/models", timeout=5.0)
                data = (resp.json().get("data") or [{}])[0] if resp.status_code == 200 else {}
            except (httpx.HTTPError, ValueError, AttributeError):
                data = {}
            engine.model = data.get("id") or engine.model or "default"
            engine.max_model_len = data.get("max_model_len") or engine.max_model_len
            engine.discovered_at = time.monotonic()
        return engine

    # --- calls ---------------------------------------------------------------------------

    def _headers(self, episode_id: int | None) -> dict:
        h = {"content-type": "application/json"}
        if episode_id is not None:
            h["x-turnstile-episode"] = str(episode_id)  # not a secret: lets engines group a session
        return h

    def _post(self, engine: Engine, path: str, body: dict, episode_id: int | None, stream: bool):
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        req = self.client.build_request("POST", f"{engine.url}{path}", content=data,
                                        headers=self._headers(episode_id))
        try:
            resp = self.client.send(req, stream=stream)
        except httpx.TimeoutException as exc:
            raise GatewayError("upstream", f"The engine at {engine.url} timed out: {exc}") from exc
        except httpx.HTTPError as exc:
            raise GatewayError("upstream", f"The engine at {engine.url} is unreachable: {exc}") from exc
        if resp.status_code >= 400:
            if stream:
                resp.read()
                resp.close()
            raise map_engine_error(resp.status_code, _message_of(resp))
        return resp

    def _with_clamp(self, engine: Engine, body: dict, call):
        """Run `call(body)`; on an overflow caused by max_tokens alone, retry once clamped (B38)."""
        if engine.max_model_len and body.get("max_tokens") and body["max_tokens"] > engine.max_model_len:
            body["max_tokens"] = engine.max_model_len
        try:
            return call(body)
        except GatewayError as err:
            if err.kind != "context_length" or err.prompt_tokens is None or err.max_context is None:
                raise
            room = err.max_context - err.prompt_tokens
            if room < 1 or body.get("max_tokens") is None or body["max_tokens"] <= room:
                raise
            log.info("clamping max_tokens %s -> %s (prompt %s, context %s)", body["max_tokens"], room,
                     err.prompt_tokens, err.max_context)
            body["max_tokens"] = room
            return call(body)

    def complete(self, engine: Engine, body: dict, episode_id: int | None) -> dict:
        """Non-stream chat completion -> the engine's JSON body (raises GatewayError)."""
        def call(b):
            resp = self._post(engine, "/v1/chat/completions", b, episode_id, stream=False)
            try:
                return resp.json()
            except ValueError as exc:
                raise GatewayError("upstream", "The engine returned invalid JSON") from exc
        return self._with_clamp(engine, body, call)

    def open_stream(self, engine: Engine, body: dict, episode_id: int | None) -> StreamHandle:
        """Streamed chat completion; returns once the engine accepted it (status 200)."""
        return self._with_clamp(engine, body, lambda b: StreamHandle(
            self._post(engine, "/v1/chat/completions", b, episode_id, stream=True)))

    def tokenize(self, engine: Engine, body: dict) -> dict:
        """vLLM POST /tokenize (messages form) -> {count, max_model_len, tokens}."""
        resp = self._post(engine, "/tokenize", body, None, stream=False)
        return resp.json()


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
