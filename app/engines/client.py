"""The project's one client of the inference engines (embedded engine, scripted engine or vLLM).

``EngineClient`` speaks the engine contract documented in ``app.engines.embedded.server`` (OpenAI Chat
Completions, https://platform.openai.com/docs/api-reference/chat, plus vLLM's extensions:
``return_token_ids``, ``/tokenize``, ``/detokenize``, ``max_model_len`` in ``/v1/models``).  The
gateway, the trainer's weight sync, the vLLM reloader, the benches and the scripts all use it.
Chat completions, the gateway's per-call hop, are read on the caller's thread by
``app.engines.stream`` (its own HTTP/1.1 reader on the socket: relaying a token costs no thread
hand-off, and a non-stream answer costs half what httpx's request machinery does): streams
by ``ChatStream``, parsed with ``app.engines.sse.SSEDecoder`` (WHATWG event-stream rules), whole
answers by ``app.engines.answer.ChatAnswer``.  Every other call (models, tokens, weights, health) goes over httpx,
the HTTP library the OpenAI and Anthropic SDKs bring.

With a vLLM server every call works except ``reload`` / ``reset_to_base`` (use
``app.engines.vllm.VLLMReloader``) and ``policy_version``.

Errors: a non-2xx answer raises ``EngineHTTPError`` (status and parsed body kept); a transport
failure (refused, reset, timed out, malformed HTTP) raises ``EngineConnectionError``.  Both are
``EngineCallError`` (defined in ``app.engines.errors``, re-exported here).  The httpx
connections underneath are ``app.engines.transport``'s.
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Any, Callable, Iterator

import httpx

from app.engines.errors import (EngineCallError, EngineConnectionError, EngineHTTPError, connection_error,
                                error_message, parse_body)
from app.engines.answer import ChatAnswer
from app.engines.connections import Target
from app.engines.routed import normalize_routed_experts
from app.engines.stream import DONE, EOF, ChatStream, stream_items
from app.engines.transport import one_write_transport

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

__all__ = ["DONE", "EOF", "ChatStream", "EngineCallError", "EngineClient", "EngineConnectionError", "EngineHTTPError",
           "error_message", "stream_items", "weights_label"]


def weights_label(spec: str | os.PathLike) -> str:
    """The name an engine reports for the weights it serves (``GET /v1/policy_version`` ``weights``).

    A model folder is named by its real path, so the folder an engine was started from and the
    same folder loaded later get one name; any other spec (``"smollm2"``, ``"tiny"``, a hub id)
    is its own name.  The trainer sends this name with every load, so an engine on another
    machine, which never sees the trainer's paths, reports the same name the trainer expects.
    A policy version alone cannot tell two starting points apart: a train run numbers the
    checkpoint it starts from 0, as the base model is 0.
    """
    return os.path.realpath(spec) if os.path.isdir(spec) else str(spec)


class EngineClient:
    """Synchronous, thread-safe client with keep-alive connections to one engine.

    Args:
        base_url: server root (``http://127.0.0.1:8200``, no ``/v1``).
        timeout: seconds a request may wait for the engine to send anything (generation can be
            long on CPU; default 600).
        connect_timeout: seconds to establish a connection (default 5).
        max_keepalive: idle connections kept for reuse (the gateway relays many at once).
        admin_token: bearer token of the admin routes (``reload``, ``reset_to_base``); default: the
            deployment's API token (``app.auth.api_token()``), read when first needed.

    Proxy environment variables are ignored (``trust_env=False``): engines are a direct hop.
    """

    def __init__(self, base_url: str, timeout: float = 600.0, *, connect_timeout: float = 5.0,
                 max_keepalive: int = 32, admin_token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._admin_token = admin_token
        # The request head and body are separate writes: without TCP_NODELAY, Nagle's
        # algorithm holds the body until the head is acknowledged (milliseconds per call).
        socket_options = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
        # Connections that send a request in one write (see app.engines.transport).
        transport = one_write_transport(self.base_url, max_keepalive=max_keepalive, socket_options=socket_options)
        self._http = httpx.Client(base_url=self.base_url, transport=transport, trust_env=False,
                                  timeout=httpx.Timeout(timeout, connect=min(connect_timeout, timeout)))
        self._streams = Target(self.base_url, min(connect_timeout, timeout), timeout)
        self._streams.pool.keep = max_keepalive

    def close(self) -> None:
        self._http.close()
        self._streams.pool.clear()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- plumbing --------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, *, params: dict | None = None,
                headers: dict | None = None, timeout: float | None = None) -> Any:
        """One call: ``body`` is sent as JSON (UTF-8, compact); returns the parsed JSON answer
        (or its text when it is not JSON).

        Raises:
            EngineHTTPError: the engine answered 4xx/5xx.
            EngineConnectionError: transport failure or timeout.
        """
        kwargs: dict[str, Any] = {"params": params, "headers": dict(headers or {})}
        if body is not None:
            kwargs["content"] = _dumps(body).encode("utf-8")
            kwargs["headers"]["Content-Type"] = "application/json"
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise connection_error(exc, self.base_url) from exc
        parsed = parse_body(response)
        if response.status_code >= 400:
            raise EngineHTTPError(response.status_code, parsed)
        return parsed

    # --- status -----------------------------------------------------------------------------

    def health(self, wait_s: float = 0.0) -> dict:
        """``GET /health``; with ``wait_s`` > 0 retry connection errors / 5xx until it answers.

        Raises:
            TimeoutError: not healthy within ``wait_s`` seconds.
        """
        deadline = time.monotonic() + wait_s
        while True:
            try:
                body = self.request("GET", "/health", timeout=5.0)
                return body if isinstance(body, dict) else {"status": "ok"}  # vLLM answers an empty body
            except EngineCallError as exc:
                last = str(exc)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"engine {self.base_url} not healthy after {wait_s:.0f}s ({last})")
            time.sleep(0.2)

    def models(self, timeout: float | None = 5.0) -> list[dict]:
        """``GET /v1/models`` -> the ``data`` list (each ``{"id", "max_model_len", …}``)."""
        body = self.request("GET", "/v1/models", timeout=timeout)
        data = body.get("data") if isinstance(body, dict) else None
        return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []

    def policy_version(self) -> int:
        """``GET /v1/policy_version`` (embedded and scripted engines) -> the version it serves
        (``serving()[0]``; raises as ``serving``)."""
        return self.serving()[0]

    def serving(self) -> tuple[int, str | None]:
        """``GET /v1/policy_version`` -> ``(policy version, weights name)``: the name
        (``weights_label``) is ``None`` from an engine that does not report one.

        Raises:
            EngineHTTPError: the engine has no such route (vLLM: 404) or refused.
            EngineConnectionError: transport failure or timeout.
            ValueError: the answer is not an object with an integer ``policy_version``.
        """
        answer = self.request("GET", "/v1/policy_version")
        if not isinstance(answer, dict) or not isinstance(answer.get("policy_version"), int):
            raise ValueError(f"GET /v1/policy_version answered {str(answer)[:200]!r}, not a policy version")
        weights = answer.get("weights")
        return answer["policy_version"], (str(weights) if weights is not None else None)

    # --- generation -------------------------------------------------------------------------

    def chat(self, messages: list[dict], *, stream: bool = False, **fields: Any) -> dict | Iterator[dict]:
        """``POST /v1/chat/completions``.  Extra keyword fields go into the JSON body verbatim
        (``model``, ``max_tokens``, ``temperature``, ``seed``, ``tools``, ``logprobs``,
        ``return_token_ids`` …).

        Returns the response object, or (``stream=True``) an iterator of chunk objects that
        stops at ``[DONE]`` (see ``ChatStream.__iter__`` for its errors).

        Raises:
            EngineHTTPError, EngineConnectionError.
        """
        body = {"messages": messages, **fields}
        if not stream:
            return self.complete(body)
        return self._iterate(self.open_stream({**body, "stream": True}))

    @staticmethod
    def _iterate(chat_stream: ChatStream) -> Iterator[dict]:
        with chat_stream:
            yield from chat_stream

    def complete(self, body: dict, *, headers: dict | None = None, idle: Callable[[], None] | None = None,
                 idle_s: float = 0.25) -> dict:
        """Non-stream ``POST /v1/chat/completions`` with the full request ``body`` as given, on the
        streams' kept connections (``app.engines.answer.ChatAnswer``).

        ``idle()``, when given, is called every ``idle_s`` seconds while the engine is silent (a
        non-stream answer is silent until it is done); an exception it raises abandons the call,
        closing the connection so the engine aborts the request, and propagates to the caller.

        A vLLM answer's routed experts (base64 ``.npy`` per choice) are rewritten to the embedded
        engine's top-level ``routed_experts`` list, kept only when ``body`` asked for them
        (``app.engines.routed.normalize_routed_experts``).

        Raises:
            EngineHTTPError: the engine answered 4xx/5xx.
            EngineConnectionError: transport failure or timeout.
            ValueError: vLLM's routed experts do not decode.
        """
        with ChatAnswer(self._streams, body, headers) as call:
            answer = call.result(idle, idle_s)
        return normalize_routed_experts(answer, bool(body.get("return_routed_experts")))

    def open_stream(self, body: dict, *, headers: dict | None = None) -> ChatStream:
        """Start a streamed ``POST /v1/chat/completions`` with ``body`` as given (it should say
        ``"stream": true``); returns once the request is sent (on a kept connection, or a new one
        within the connect timeout; a failure to connect is the stream's ``error``), the answer is
        read on the caller's thread by ``ChatStream.wait`` / ``poll``.

        Raises:
            ValueError: a header name or value that cannot go on the wire (CR, LF, NUL).
        """
        return ChatStream(self._streams, body, headers)

    # --- tokens -----------------------------------------------------------------------------

    def tokenize(self, messages: list[dict] | None = None, *, prompt: str | None = None,
                 tools: list | None = None, add_generation_prompt: bool = True, **fields: Any) -> list[int]:
        """Prompt token ids exactly as the engine renders them (``POST /tokenize``, vLLM's shape);
        extra keyword fields (``model``, ``chat_template_kwargs`` …) go into the body verbatim."""
        body: dict[str, Any] = {"prompt": prompt} if messages is None else {
            "messages": messages, "add_generation_prompt": add_generation_prompt}
        if tools:
            body["tools"] = tools
        body.update(fields)
        return self.request("POST", "/tokenize", body)["tokens"]

    def detokenize(self, tokens: list[int]) -> str:
        """``POST /detokenize`` -> the text of ``tokens``."""
        return self.request("POST", "/detokenize", {"tokens": tokens})["prompt"]

    # --- weights (embedded engine) ----------------------------------------------------------

    def reload(self, path: str, policy_version: int, *, weights: str | None = None,
               timeout: float | None = None, mode: str | None = None, recompute_kv: bool | None = None) -> int:
        """Load the checkpoint directory ``path`` and tag later tokens with ``policy_version``
        (``POST /v1/load_weights {"path", "policy_version", "weights", "mode", "recompute_kv"}``;
        ``weights`` names what the engine then reports serving, default the folder's real path as
        the engine sees it).

        ``mode`` is the weight update mode (``keep``: running requests continue on the new weights
        between two decode steps; ``wait``: they finish on the old ones first; ``abort``: they end
        now; None: the engine's default); ``recompute_kv`` whether ``keep`` re-prefills them.
        Blocks until the new weights are in place; returns the engine's new policy version.
        Raises EngineHTTPError (400 with ``param`` "mode") for a mode the engine does not know.
        """
        body: dict[str, Any] = {"path": str(path), "policy_version": int(policy_version)}
        if weights is not None:
            body["weights"] = weights
        if mode is not None:
            body["mode"] = mode
        if recompute_kv is not None:
            body["recompute_kv"] = bool(recompute_kv)
        return int(self.request("POST", "/v1/load_weights", body, timeout=timeout,
                                headers=self._admin_headers())["policy_version"])

    def reset_to_base(self, *, timeout: float | None = None) -> int:
        """Back to the weights the engine was started with, as policy version 0
        (``POST /v1/load_weights {"base": true, "policy_version": 0}``); returns the new version."""
        body = {"base": True, "policy_version": 0}
        return int(self.request("POST", "/v1/load_weights", body, timeout=timeout,
                                headers=self._admin_headers())["policy_version"])

    def load_lora_adapter(self, name: str, folder: str, policy_version: int | None = None, *,
                          timeout: float | None = None) -> None:
        """Serve the LoRA adapter in ``folder`` as ``name`` (``POST /v1/load_lora_adapter``: vLLM's
        runtime LoRA route, which the embedded engine serves too; the embedded engine also reads
        ``policy_version``, vLLM ignores it).  Loading a name already served is not an error (a
        name is its content: ``app.engines.lora_format``).

        Raises:
            EngineHTTPError: the engine refused the adapter.
            EngineConnectionError: transport failure or timeout.
        """
        body: dict[str, Any] = {"lora_name": name, "lora_path": str(folder)}
        if policy_version is not None:
            body["policy_version"] = int(policy_version)
        try:
            self.request("POST", "/v1/load_lora_adapter", body, timeout=timeout, headers=self._admin_headers())
        except EngineHTTPError as exc:
            if not (exc.status == 400 and "already been loaded" in exc.message):  # vLLM's answer to a second load
                raise

    def _admin_headers(self) -> dict[str, str]:
        """The bearer token of the engines' admin routes: ``admin_token``, else the deployment's API token."""
        if self._admin_token is not None:
            return {"Authorization": f"Bearer {self._admin_token}"}
        from app.auth import auth_header

        return auth_header()
