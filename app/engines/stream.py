"""A streamed chat completion read on the caller's own thread: one socket, no reader thread.

``ChatStream`` sends ``POST /v1/chat/completions`` over a plain (or TLS) socket and reads the
HTTP/1.1 answer itself (RFC 9112: status line, header fields, then a body framed by
``Transfer-Encoding: chunked``, ``Content-Length`` or the connection's close).  Each ``poll`` waits
on the socket with ``select.poll`` (in a gevent worker: a watcher on gevent's loop, ``_HubWait``)
for at most its timeout and turns everything one ``recv``
brought into items: the body's chunk framing is undone in one pass, the SSE events are parsed by
``app.engines.sse.SSEDecoder`` and each ``data`` is one JSON chunk (``stream_items``).  So a
caller can wait with a timeout (and send a keep-alive while the engine is silent) without a
thread per stream and without a hand-off per network read: relaying a token costs one ``poll``
and one ``recv`` on the thread that writes it on.

Connections whose answer was read to its end are kept for the next stream of the same client
(``SocketPool``, emptied in a forked child); one that went stale while idle is noticed before
reuse, and an answer cut before its first byte on a reused connection is retried once on a new one.
"""
from __future__ import annotations

import json
import os
import re
import select
import socket
import ssl
import sys
import threading
import time
from typing import Callable, Iterator
from urllib.parse import urlsplit

try:
    import orjson
except ImportError:  # vLLM's own venv imports this module for its reload plugin, without orjson
    orjson = None

from app.engines.errors import EngineCallError, EngineConnectionError, EngineHTTPError
from app.engines.sse import SSEDecoder

DONE = object()   # stream item: the engine sent ``data: [DONE]``
EOF = object()    # stream item: the engine closed the stream without ``[DONE]``

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_MAX_HEAD = 64 * 1024      # bytes of status line + header fields accepted
_MAX_ERROR_BODY = 1 << 20  # bytes of a refusal's body read
_RECV = 256 * 1024
_AGAIN = object()          # a read that found nothing after all (spurious wake-up, TLS record not whole)


def _loads(text: str):
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
            items.append(_loads(data))
        except ValueError as exc:
            items.append(exc)
            return items
    return items


def _gevent_select() -> bool:
    """True in a process whose `select` module gevent has monkey-patched (a gevent gateway worker)."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and monkey.is_module_patched("select")


class _WaitClosed(Exception):
    """Thrown into a greenlet waiting in `_HubWait.poll` when another greenlet closes the stream."""


class _HubWait:
    """`select.poll` of one socket for a greenlet, on gevent's own loop (the gevent gateway worker).

    gevent's `select.poll` stand-in builds an io watcher and a `gevent.Timeout` (a timer and a
    Python object) on every call; this keeps one io watcher for the connection and starts a bare
    loop timer per timed wait.  At 200 tokens/s per stream, where every token is a wait, the gateway
    spent 19% less CPU per relayed token at 16 sessions and 13% less at 64 (five and four
    alternating runs of each, bench/gateway.py --token-rate's load); one fast stream, whose reads
    carry several tokens, did not change.  `close` from another greenlet wakes a waiting
    `poll` at once (`Hub.cancel_wait`), as `socket.shutdown` wakes a blocked `select.poll`.
    gevent's loop and watcher API: https://www.gevent.org/api/gevent.hub.html
    """

    def __init__(self, sock: socket.socket) -> None:
        from gevent.hub import Waiter, get_hub  # gevent is only imported where it already runs
        self._hub, self._waiter = get_hub(), Waiter
        self._io = self._hub.loop.io(sock.fileno(), 1)  # 1: readable (libev's EV_READ)
        self._closed = False

    def poll(self, ms: int) -> bool:
        """True when the socket is readable, or the wait was closed, within `ms` ms (-1: no limit)."""
        if self._closed:
            return True  # the read that follows finds the connection gone
        waiter = self._waiter(self._hub)
        self._io.start(waiter.switch, True)
        timer = None
        if ms >= 0:
            timer = self._hub.loop.timer(ms / 1000)
            timer.start(waiter.switch, False)
        try:
            return waiter.get()
        except _WaitClosed:
            return True
        finally:
            self._io.stop()
            if timer is not None:
                timer.close()

    def close(self) -> None:
        """Release the watcher; a greenlet waiting on it wakes (its `poll` returns True)."""
        if not self._closed:
            self._closed = True
            self._hub.cancel_wait(self._io, _WaitClosed(), True)


class Target:
    """Where a client's streams go: ``base_url`` split into (scheme, host, port, path prefix)."""

    def __init__(self, base_url: str, connect_timeout: float, timeout: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine URL must be http(s)://host[:port][/prefix], got {base_url!r}")
        self.base_url = base_url
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.authority = parts.netloc.rsplit("@", 1)[-1]
        self.path = parts.path.rstrip("/") + "/v1/chat/completions"
        self.connect_timeout, self.timeout = connect_timeout, timeout
        self._ssl: ssl.SSLContext | None = None
        self.pool = SocketPool()

    def ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl


class SocketPool:
    """Idle engine connections of one client, newest first; a forked child starts empty (a
    socket shared with the parent would mix two processes' answers)."""

    def __init__(self, keep: int = 256) -> None:
        self.keep = keep
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def take(self) -> socket.socket | None:
        """An idle connection still open (a readable idle socket is one the engine closed), or None."""
        with self._lock:
            if self._pid != os.getpid():
                self._idle, self._pid = [], os.getpid()
            while self._idle:
                sock = self._idle.pop()
                p = select.poll()
                p.register(sock, select.POLLIN | select.POLLPRI)
                if not p.poll(0):
                    return sock
                _close(sock)
        return None

    def give(self, sock: socket.socket) -> None:
        with self._lock:
            if self._pid == os.getpid() and len(self._idle) < self.keep:
                self._idle.append(sock)
                return
        _close(sock)

    def clear(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def _request_bytes(target: Target, body: dict, headers: dict | None, accept: str) -> bytes:
    data = _dumps(body).encode("utf-8")
    lines = [f"POST {target.path} HTTP/1.1", f"Host: {target.authority}", "Content-Type: application/json",
             f"Accept: {accept}", "Accept-Encoding: identity", f"Content-Length: {len(data)}"]
    for k, v in (headers or {}).items():
        k, v = str(k), str(v)
        if any(c in k + v for c in "\r\n\0") or not k or ":" in k:
            raise ValueError(f"invalid header for the engine request: {k!r}")
        lines.append(f"{k}: {v}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data


class _BodyReader:
    """Undoes the body's framing in one pass per network read: ``feed(bytes)`` -> payload bytes.

    mode: "chunked" | "length" | "close".  ``complete`` becomes True at the end of a chunked or
    sized body; ``clean`` is False when bytes came after it (the connection is then not reused).
    Malformed chunk framing sets ``broken`` (what was wrong); the payload before it is still
    returned, and every later ``feed`` raises.

    Raises (from ``feed``):
        ValueError: the framing was found malformed in an earlier read.
    """

    def __init__(self, mode: str, length: int = 0) -> None:
        self.mode, self.left = mode, length
        self.complete = mode == "length" and length == 0
        self.clean = True
        self._raw = b""
        self._state = "size"   # chunked: size | data | crlf | trailer
        self.broken: str | None = None

    def feed(self, data: bytes) -> bytes:
        if self.broken is not None:
            raise ValueError(self.broken)
        if self.complete:
            if data:
                self.clean = False
            return b""
        if self.mode == "close":
            return data
        if self.mode == "length":
            take = data[:self.left]
            self.left -= len(take)
            self.complete = self.left == 0
            if len(data) > len(take):
                self.clean = False
            return take
        out: list[bytes] = []
        try:
            self._chunked(self._raw + data if self._raw else data, out)
        except ValueError as exc:
            self.broken = str(exc)
        return out[0] if len(out) == 1 else b"".join(out)

    def _chunked(self, buf: bytes, out: list[bytes]) -> None:
        i, n = 0, len(buf)
        while i < n:
            state = self._state
            if state == "data":
                take = min(self.left, n - i)
                out.append(buf[i:i + take])
                i += take
                self.left -= take
                if not self.left:
                    self._state = "crlf"
                continue
            if state == "crlf":
                if n - i < 2:
                    break
                if buf[i:i + 2] != b"\r\n":
                    raise ValueError("chunk data not followed by CRLF")
                i += 2
                self._state = "size"
                continue
            j = buf.find(b"\r\n", i)
            if j < 0:
                if n - i > 4096:
                    raise ValueError("chunk line too long")
                break
            line = buf[i:j]
            i = j + 2
            if state == "trailer":
                if not line:
                    self.complete = True
                    if i < n:
                        self.clean = False
                    i = n
                continue
            size = line.split(b";", 1)[0].strip()
            if not _HEX.fullmatch(size):
                raise ValueError(f"bad chunk size line {line[:40]!r}")
            self.left = int(size, 16)
            self._state = "data" if self.left else "trailer"
        self._raw = buf[i:]


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
        self._raw = _request_bytes(target, body, headers, self.ACCEPT)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._poller: select.poll | None = None
        self._reused = False
        self._phase = "send"      # send | head | body | done
        self._head = b""
        self._body: _BodyReader | None = None
        self._sse = SSEDecoder()
        self._pending: list = []
        self._ended = False       # DONE, EOF or an error was handed out (or is pending)
        self._cancelled = False
        self._finished = threading.Event()  # the socket is closed or back in the pool
        self._last = time.monotonic()
        self._open()

    # --- connecting and the head ---------------------------------------------------------------

    def _open(self) -> None:
        """A kept connection, else a new one (``socket.create_connection``: every address the
        name resolves to, IPv4 or IPv6, within the connect timeout); then the request is sent."""
        sock = self._t.pool.take()
        self._reused = sock is not None
        if sock is None:
            try:
                sock = socket.create_connection((self._t.host, self._t.port), timeout=self._t.connect_timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
        if _gevent_select():  # (a replaced connection's watcher was released by `_retry`)
            self._poller = _HubWait(sock)
        else:
            self._poller = select.poll()
            self._poller.register(sock, select.POLLIN | select.POLLPRI)
        self._phase = "head"
        self._last = time.monotonic()

    def _retry(self) -> None:
        """A reused connection the engine had closed: once more on a new one."""
        self._drop_poller()
        _close(self._sock)
        self._sock, self._head = None, b""
        try:
            sock = socket.create_connection((self._t.host, self._t.port), timeout=self._t.connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
                if len(self._head) > _MAX_HEAD:
                    self._fail_head(EngineConnectionError(f"engine {self.base_url} sent an oversized head"))
                    return True
                continue
            head, rest = self._head[:end], self._head[end + 4:]
            self._head = b""
            try:
                self._parse_head(head)
            except ValueError as exc:
                self._fail_head(EngineConnectionError(f"engine {self.base_url} sent malformed HTTP: {exc}"))
                return True
            if self.status >= 400:
                self._read_refusal(rest)
                return True
            self._phase = "body"
            if rest:
                self._take(rest)
        return True

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        proto, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not proto.startswith("HTTP/1.") or not code.isdigit():
            raise ValueError(f"bad status line {lines[0][:60]!r}")
        self.status = int(code)
        fields: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise ValueError(f"bad header line {line[:60]!r}")
            key = name.lower()
            fields[key] = f"{fields[key]}, {value.strip()}" if key in fields else value.strip()
        self._keep = proto == "HTTP/1.1" and "close" not in fields.get("connection", "").lower()
        te = fields.get("transfer-encoding", "").lower()
        if te:
            if te.replace(" ", "").split(",")[-1] != "chunked":
                raise ValueError(f"unsupported transfer-encoding {te!r}")
            self._body = _BodyReader("chunked")
        elif "content-length" in fields:
            length = fields["content-length"]
            if not length.isdigit():
                raise ValueError(f"bad content-length {length!r}")
            self._body = _BodyReader("length", int(length))
        else:
            self._body = _BodyReader("close")
            self._keep = False

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

    def _drop_poller(self) -> None:
        """Release a gevent watcher before its socket is closed, pooled or replaced (a closed one
        answers every later wait at once, as `select.poll` does for a closed socket)."""
        if isinstance(self._poller, _HubWait):
            self._poller.close()

    def _release(self, reuse: bool) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            self._drop_poller()
            if reuse and not self._cancelled:
                self._t.pool.give(sock)
            else:
                _close(sock)
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
            return [_loads(text)]
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
