"""A non-stream chat completion on the streams' sockets, read whole on the caller's thread.

``ChatAnswer`` is a ``ChatStream`` (same request, head, pool and timeouts) whose body is not
split into SSE events: its payload is gathered and parsed once as JSON at the end of the body.
"""
from __future__ import annotations

from typing import Callable

from app.engines.connections import Target
from app.engines.errors import EngineConnectionError
from app.engines.stream import ChatStream, loads_json


class ChatAnswer(ChatStream):
    """A non-stream ``POST /v1/chat/completions`` on the streams' sockets and pool, read on the
    caller's thread: ``result(idle, idle_s)`` -> the engine's JSON answer (or its text when it is
    not JSON).  Measured against the scripted engine on one connection: 0.33-0.46 ms per call
    here, against 0.78-1.0 ms through httpx (request building, h11 and the response model cost
    more than the call itself).

    The body is read whole (sized, chunked or up to the connection's close) and parsed once.
    """

    ACCEPT = "application/json"

    def __init__(self, target: Target, body: dict, headers: dict | None) -> None:
        self._parts: list[bytes] = []
        super().__init__(target, body, headers)

    def _payload(self, payload: bytes) -> None:
        self._parts.append(payload)

    def _last_items(self) -> list:
        """The whole answer parsed (its text when it is not JSON), or an error when a sized or
        chunked body ended before its end."""
        if self._body.mode != "close" and not self._body.complete:
            return [EngineConnectionError(f"engine {self.base_url} closed the connection before the whole answer")]
        text = b"".join(self._parts).decode("utf-8", "replace")
        try:
            return [loads_json(text)]
        except ValueError:
            return [text]

    def result(self, idle: Callable[[], None] | None = None, idle_s: float = 0.25):
        """The whole answer.  ``idle()``, when given, runs every ``idle_s`` seconds while the engine
        is silent (before its head, and until the body is whole); what it raises propagates, and
        the caller's ``close`` then shuts the connection, so the engine aborts the request.

        Raises:
            EngineHTTPError: the engine answered 4xx/5xx (its parsed body kept).
            EngineConnectionError: unreachable, reset, silent past the read timeout, malformed
                HTTP, or closed before the whole body.
        """
        slice_s = idle_s if idle is not None else None
        while not self.wait(slice_s):
            idle()
        if self.error is not None:
            raise self.error
        while True:
            items = self.poll(slice_s)
            if items:
                if isinstance(items[0], Exception):
                    raise items[0]
                return items[0]
            if self._ended:
                raise EngineConnectionError(f"engine {self.base_url} ended without an answer")
            if idle is not None:
                idle()
