"""A streamed chat completion read on the caller's own thread: one socket, no reader thread.

``ChatStream`` sends ``POST /v1/chat/completions`` over a plain (or TLS) socket and reads the
HTTP/1.1 answer itself (its framing: ``app.engines.http1``).  Each ``poll`` waits on the socket
(``app.engines.socket_wait``: ``select.poll``, or in a gevent worker a watcher on gevent's loop)
for at most its timeout and turns everything one ``recv`` brought into items: the body's chunk
framing is undone in one pass, the SSE events are parsed by ``app.engines.sse.SSEDecoder`` and
each ``data`` is one JSON chunk (``stream_items``).  So a caller can wait with a timeout (and send
a keep-alive while the engine is silent) without a thread per stream and without a hand-off per
network read: relaying a token costs one ``poll`` and one ``recv`` on the thread that writes it on.

Connections whose answer was read to its end are kept for the next stream of the same client
(``app.engines.connections.SocketPool``); an answer cut before its first byte on a reused
connection is retried once on a new one.  The non-stream call on the same sockets is
``app.engines.answer.ChatAnswer``.
"""
from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from typing import Iterator

try:
    import orjson
except ImportError:  # vLLM's own venv imports this module for its reload plugin, without orjson
    orjson = None

from app.engines.connections import Target, close_quietly
from app.engines.errors import EngineCallError, EngineConnectionError, EngineHTTPError
from app.engines.http1 import MAX_HEAD, BodyReader, parse_head, request_bytes
from app.engines.socket_wait import readable_waiter, release_waiter
from app.engines.sse import SSEDecoder

DONE = object()   # stream item: the engine sent ``data: [DONE]``
EOF = object()    # stream item: the engine closed the stream without ``[DONE]``

_MAX_ERROR_BODY = 1 << 20  # bytes of a refusal's body read
_RECV = 256 * 1024
_AGAIN = object()          # a read that found nothing after all (spurious wake-up, TLS record not whole)


def loads_json(text: str):
    """``json.loads(text)``, through orjson (1.1–2.1 vs 5.2–5.7 µs per 288-byte chunk here with the
    stdlib's parser; engine chunks are strict JSON): the same object, or the same ValueError, since
    what orjson refuses (NaN or Infinity, lone surrogates, bad JSON) goes to ``json.loads``, which
    decides as it always did.  One difference: an integer beyond 64 bits becomes the nearest float
    (orjson's rule), where ``json.loads`` keeps it exact; no field of a chat chunk holds one (token
    ids are below 2**31, ``created`` is a Unix time)."""
    if orjson is not None:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return json.loads(text)


def stream_items(events: list[tuple[str | None, str]]) -> list:
    """SSE events of a chat stream -> items: chunk dicts, then ``DONE`` or a ``ValueError`` (bad
    JSON), each of which ends the list; events with empty data are skipped."""
    items: list = []
    for _event, data in events:
        if data == "[DONE]" or data.strip() == "[DONE]":
            items.append(DONE)
            return items
        if not data.strip():
            continue
        try:
            items.append(loads_json(data))
        except ValueError as exc:
            items.append(exc)
            return items
    return items


class ChatStream:
    """A streamed ``POST /v1/chat/completions``, read on the caller's thread.

    Use ``wait`` for the response head, then ``poll`` for items, and always ``close``.  ``status``
    is the engine's HTTP status once known; ``error`` is set, with the head, when the engine
    refused (``EngineHTTPError``) or could not be reached (``EngineConnectionError``).  A silent
    engine is given ``timeout`` seconds (the client's read timeout) per wait for bytes.

    Not for two threads at once, except ``close``, which may come from another thread: it shuts
    the connection down, so a ``poll`` blocked on it wakes at once.
    """

    ACCEPT = "text/event-stream"

    def __init__(self, target: Target, body: dict, headers: dict | None) -> None:
        self.base_url = target.base_url
        self.status: int | None = None
        self.error: EngineCallError | None = None
        self._t = target
        self._raw = request_bytes(target.path, target.authority, body, headers, self.ACCEPT)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._poller = None       # readable_waiter(sock) once the request is sent
        self._reused = False
        self._phase = "send"      # send | head | body | done
        self._head = b""
        self._body: BodyReader | None = None
        self._keep = False        # the connection may serve the next call after this answer
        self._sse = SSEDecoder()
        self._pending: list = []
        self._ended = False       # DONE, EOF or an error was handed out (or is pending)
        self._cancelled = False
        self._finished = threading.Event()  # the socket is closed or back in the pool
        self._last = time.monotonic()
        self._open()

    # --- connecting and the head ---------------------------------------------------------------

    def _open(self) -> None:
        """A kept connection, else a new one (``Target.connect``); then the request is sent."""
        sock = self._t.pool.take()
        self._reused = sock is not None
        if sock is None:
            try:
                sock = self._t.connect()
            except OSError as exc:  # refused, unresolvable, timed out
                self._fail_head(EngineConnectionError(f"engine {self.base_url} is unreachable: {exc}"))
                return
        self._sock = sock
        self._send()

    def _fail_head(self, err: EngineCallError) -> None:
        self.error = err
        self._ended = True
        self._phase = "done"
        self._release(reuse=False)

    def _send(self) -> None:
        sock = self._sock
        try:
            sock.settimeout(self._t.timeout)
            if self._t.tls and not isinstance(sock, ssl.SSLSocket):
                sock = self._t.ssl_context().wrap_socket(sock, server_hostname=self._t.host)
                self._sock = sock
            sock.sendall(self._raw)
            sock.setblocking(False)
        except OSError as exc:
            if self._reused:
                return self._retry()
            return self._fail_head(EngineConnectionError(f"connection to engine {self.base_url} failed: "
                                                         f"{type(exc).__name__}: {exc}"))
        self._poller = readable_waiter(sock)  # (a replaced connection's watcher was released by `_retry`)
        self._phase = "head"
        self._last = time.monotonic()

    def _retry(self) -> None:
        """A reused connection the engine had closed: once more on a new one."""
        release_waiter(self._poller)  # before its socket is closed, pooled or replaced
        close_quietly(self._sock)
        self._sock, self._head = None, b""
        try:
            sock = self._t.connect()
        except OSError as exc:
            return self._fail_head(EngineConnectionError(f"engine {self.base_url} is unreachable: {exc}"))
        self._sock, self._reused = sock, False
        self._send()

    def _wait_io(self, timeout: float | None) -> bool:
        """True when the socket is ready within `timeout` seconds (TLS: bytes already decrypted count)."""
        if isinstance(self._sock, ssl.SSLSocket) and self._sock.pending():
            return True
        ms = -1 if timeout is None else max(0, int(timeout * 1000 + 0.999))
        try:
            return bool(self._poller.poll(ms))
        except (OSError, ValueError):
            return True  # a socket closed under us: the read that follows tells

    def _slice(self, deadline: float | None, limit: float) -> float:
        """Seconds to wait now: to `deadline`, and no longer than the silence `limit` allows."""
        now = time.monotonic()
        left = self._last + limit - now
        if deadline is not None:
            left = min(left, deadline - now)
        return max(0.0, left)

    def _advance_head(self, deadline: float | None) -> bool:
        """Work towards the head until it is known (True) or `deadline` passes (False)."""
        while self._phase == "head":
            limit = self._t.timeout
            if not self._wait_io(self._slice(deadline, limit)):
                if self._silent_too_long(limit):
                    return True
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                continue
            data = self._recv()
            if data is None:
                return True
            if data is _AGAIN:
                continue
            if not data:
                if self._reused and not self._head:
                    self._retry()
                    continue
                self._fail_head(EngineConnectionError(f"engine {self.base_url} closed the connection "
                                                      f"before its answer's head"))
                return True
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > MAX_HEAD:
                    self._fail_head(EngineConnectionError(f"engine {self.base_url} sent an oversized head"))
                    return True
                continue
            head, rest = self._head[:end], self._head[end + 4:]
            self._head = b""
            try:
                parsed = parse_head(head)
            except ValueError as exc:
                self._fail_head(EngineConnectionError(f"engine {self.base_url} sent malformed HTTP: {exc}"))
                return True
            self.status, self._keep, self._body = parsed.status, parsed.keep, parsed.body
            if self.status >= 400:
                self._read_refusal(rest)
                return True
            self._phase = "body"
            if rest:
                self._take(rest)
        return True

    def _read_refusal(self, rest: bytes) -> None:
        """Read a 4xx/5xx answer's body (bounded, within the read timeout) into ``error``."""
        chunks, size = [], 0
        try:
            data = rest
            while True:
                payload = self._body.feed(data)
                chunks.append(payload)
                size += len(payload)
                if self._body.complete or size > _MAX_ERROR_BODY:
                    break
                if not self._wait_io(self._t.timeout):
                    break
                data = self._recv()
                if data is _AGAIN:
                    data = b""
                    continue
                if not data:
                    break
        except ValueError:
            pass
        text = b"".join(chunks)[:_MAX_ERROR_BODY].decode("utf-8", "replace")
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = text
        self.error = EngineHTTPError(self.status, parsed)
        self._ended = True
        self._phase = "done"
        self._release(reuse=self._body.complete and self._body.clean and self._keep)

    def _silent_too_long(self, limit: float) -> bool:
        if time.monotonic() - self._last < limit:
            return False
        err = EngineConnectionError(f"engine {self.base_url} timed out (nothing for {limit:g} s)", timed_out=True)
        if self._phase in ("head", "send"):
            self._fail_head(err)
        else:
            self._end_with(err)
        return True

    def _recv(self) -> bytes | None:
        """One read; None (after recording the failure) when the connection failed."""
        try:
            data = self._sock.recv(_RECV)
        except (BlockingIOError, ssl.SSLWantReadError):
            return _AGAIN
        except (OSError, AttributeError) as exc:
            if self._cancelled:
                self._ended = True
                self._phase = "done"
                self._release(reuse=False)
                return None
            err = EngineConnectionError(f"reading from engine {self.base_url} failed: {type(exc).__name__}: {exc}")
            if self._phase in ("head", "send"):
                self._fail_head(err)
            else:
                self._end_with(err)
            return None
        self._last = time.monotonic()
        return data

    # --- the body ------------------------------------------------------------------------------

    def _take(self, data: bytes) -> None:
        """Bytes of the body -> its payload (framing undone) -> pending items (``_payload``)."""
        try:
            payload = self._body.feed(data)
        except ValueError as exc:
            return self._end_with(EngineConnectionError(f"engine {self.base_url} sent malformed HTTP: {exc}"))
        if payload and not self._ended:
            self._payload(payload)
        if self._body.broken is not None:
            return self._end_with(EngineConnectionError(f"engine {self.base_url} sent malformed HTTP: "
                                                        f"{self._body.broken}"))
        if self._body.complete:
            self._at_eof()

    def _payload(self, payload: bytes) -> None:
        """Payload bytes -> pending items: the SSE events' chunks, ``DONE`` or an error ending them."""
        items = stream_items(self._sse.feed(payload))
        if items:
            self._pending += items
            last = items[-1]
            if last is DONE or isinstance(last, Exception):
                self._ended = True

    def _last_items(self) -> list:
        """The items the end of the body adds: what the SSE decoder still held, then ``EOF``
        unless ``[DONE]`` came."""
        items = stream_items(self._sse.close())
        if not items or items[-1] is not DONE:
            items.append(EOF)
        return items

    def _at_eof(self) -> None:
        if not self._ended:
            self._pending += self._last_items()
            self._ended = True
        reuse = self._body.complete and self._body.clean and self._keep
        self._phase = "done"
        self._release(reuse=reuse)

    def _end_with(self, err: Exception) -> None:
        if not self._ended:
            self._pending.append(err)
            self._ended = True
        self._phase = "done"
        self._release(reuse=False)

    def _release(self, reuse: bool) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            release_waiter(self._poller)  # before its socket is closed, pooled or replaced
            if reuse and not self._cancelled:
                self._t.pool.give(sock)
            else:
                close_quietly(sock)
        self._finished.set()

    # --- the caller's side ---------------------------------------------------------------------

    def wait(self, timeout: float | None) -> bool:
        """True once the engine answered (accepted: ``error`` is None; refused: ``error`` is set);
        False when ``timeout`` seconds passed first (call again)."""
        if self._phase != "head":
            return True
        return self._advance_head(None if timeout is None else time.monotonic() + timeout)

    def poll(self, timeout: float | None) -> list | None:
        """Everything received so far: chunk dicts, then ``DONE``, ``EOF`` or an exception
        (``ValueError`` for bad JSON, ``EngineConnectionError``) as the last item; None when
        ``timeout`` seconds passed without data (also when the answer ended and all was handed out)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._phase == "head" and not self._advance_head(deadline):
            return None
        if self.error is not None:
            return None
        while not self._pending and self._phase == "body":
            # poll(0) is a look, not a wait: one non-blocking read, no poller round (which under
            # gevent is a watcher set up and torn down, and a switch to the hub).
            if timeout != 0 and not self._wait_io(self._slice(deadline, self._t.timeout)):
                if self._silent_too_long(self._t.timeout):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            data = self._recv()
            if data is None:
                break
            if data is _AGAIN:
                if timeout == 0:
                    break
                continue
            if not data:  # the engine closed: EOF (a body cut short is never reused)
                self._at_eof()
                break
            self._take(data)
        if self._pending:
            items, self._pending = self._pending, []
            if self._ended and self._phase == "body":
                self._finish_after_done()
            return items
        if self._ended and timeout and not self._cancelled:  # all was handed out: nothing more will come
            time.sleep(timeout)
        return None

    def _finish_after_done(self) -> None:
        """After ``[DONE]``: the end of the body is usually in the same read; if it is not yet
        here, the connection is closed instead of waited for."""
        if self._body is not None and self._body.complete:
            self._at_eof()
            return
        self._phase = "done"
        self._release(reuse=False)

    def __iter__(self) -> Iterator[dict]:
        """Chunk dicts until ``[DONE]``; raises the engine's error (``EngineCallError``, also for an
        in-stream error object) or ``EngineConnectionError`` when the stream ends early."""
        self.wait(None)
        if self.error is not None:
            raise self.error
        while True:
            items = self.poll(None)
            if items is None:
                raise EngineConnectionError(f"engine {self.base_url} closed the stream before [DONE]")
            for item in items:
                if item is DONE:
                    return
                if item is EOF:
                    raise EngineConnectionError(f"engine {self.base_url} closed the stream before [DONE]")
                if isinstance(item, EngineCallError):
                    raise item
                if isinstance(item, Exception):
                    raise EngineConnectionError(f"engine {self.base_url} sent invalid JSON: {item}")
                if "error" in item and "choices" not in item:
                    code = item["error"].get("code") if isinstance(item["error"], dict) else None
                    raise EngineHTTPError(code if isinstance(code, int) and code >= 400 else 500, item)
                yield item

    def close(self) -> None:
        """Stop reading.  An answer not read to its end has its connection shut down and closed, so
        the engine sees the client leave and aborts the request; a finished one's connection is
        kept for reuse.  Safe from another thread while ``poll`` waits (it wakes at once)."""
        self._cancelled = True
        with self._lock:
            sock = self._sock
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes a poll blocked on it (another thread)
        except OSError:
            pass
        self._phase = "done"
        self._release(reuse=False)

    def __enter__(self) -> "ChatStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
