"""Errors of the engine client: what a call to an engine raises, and the message of an error body.

``EngineHTTPError`` (non-2xx answer, status and parsed body kept) and ``EngineConnectionError``
(refused, reset, timed out, malformed HTTP) are both ``EngineCallError``.  ``app.engines.client``
re-exports them; callers import them from there.
"""
from __future__ import annotations

import json
from typing import Any

import httpx

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class EngineCallError(RuntimeError):
    """Any failure talking to an engine."""


class EngineHTTPError(EngineCallError):
    """Non-2xx answer from the engine; ``status``, the parsed ``body`` and its ``message`` are kept."""

    def __init__(self, status: int, body: Any) -> None:
        self.status, self.body = int(status), body
        self.message = error_message(body) or f"HTTP {status}"
        super().__init__(f"engine answered {status}: {self.message}")


class EngineConnectionError(EngineCallError):
    """Transport failure: the engine is unreachable, reset the connection, sent malformed HTTP or
    stayed silent past the timeout (``timed_out``)."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def error_message(body: Any) -> str:
    """The human message of an engine error body: OpenAI ``{"error": {"message"}}``,
    ``{"error": "..."}``, FastAPI ``{"detail"}``, ``{"message"}`` or plain text (≤ 2000 chars)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        for key in ("message", "detail"):
            if body.get(key):
                return str(body[key])
        return _dumps(body)[:2000]
    if isinstance(body, (bytes, bytearray)):
        body = body.decode("utf-8", "replace")
    return str(body if body is not None else "")[:2000]


def parse_body(response: httpx.Response) -> Any:
    """The JSON of an engine's answer, or its text when it is not JSON."""
    try:
        return response.json()
    except ValueError:
        return response.text


def connection_error(exc: httpx.HTTPError, base_url: str) -> EngineConnectionError:
    """An httpx transport failure talking to ``base_url`` as ``EngineConnectionError`` (timeouts
    flagged ``timed_out``)."""
    if isinstance(exc, httpx.TimeoutException):
        return EngineConnectionError(f"engine {base_url} timed out ({type(exc).__name__})", timed_out=True)
    if isinstance(exc, httpx.ConnectError):
        return EngineConnectionError(f"engine {base_url} is unreachable: {exc}")
    return EngineConnectionError(f"connection to engine {base_url} failed: {type(exc).__name__}: {exc}")
