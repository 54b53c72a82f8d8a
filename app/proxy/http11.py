"""A small HTTP/1.1 client for the engine hop, built for streaming relay.

Why not httpx: relaying a token stream through httpx needs a reader thread (its reads cannot
time out and resume, and keep-alives must be sent while the engine is silent), which cost
two thread wake-ups and ~0.3 ms of CPU per token on the 2-core dev box.  Here the request
thread itself reads with a socket timeout: a timeout with nothing consumed leaves the stream
intact, so the caller sends a keep-alive and reads on.  Supports exactly what the engine
contract needs: JSON POST/GET, Content-Length and chunked bodies (RFC 9112 §7.1),
keep-alive connection reuse, TCP_NODELAY.
"""
from __future__ import annotations

import socket
import threading
from urllib.parse import urlsplit


class HTTPError(Exception):
    """Connection-level failure (refused, reset, malformed response)."""


class Pool:
    """Keep-alive sockets to one origin (`http://host:port`)."""

    def __init__(self, url: str, connect_timeout: float = 5.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"engine URL must be http://, got {url!r}")
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.base_path = parts.path.rstrip("/")
        self.connect_timeout = connect_timeout
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def _new(self) -> socket.socket:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except OSError as exc:
            raise HTTPError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def release(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < 256:
                self._idle.append(sock)
                return
        sock.close()

    def request(self, method: str, path: str, body: bytes = b"", headers: dict | None = None,
                timeout: float = 900.0) -> "Response":
        """Send a request; returns once it is written (read the head with `Response.head`)."""
        head = [f"{method} {self.base_path}{path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                f"Content-Length: {len(body)}", "Accept: */*"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        for attempt in (0, 1):
            with self._lock:
                sock = self._idle.pop() if self._idle and attempt == 0 else None
            reused = sock is not None
            sock = sock or self._new()
            try:
                sock.settimeout(timeout)
                sock.sendall(data)
                resp = Response(self, sock, timeout)
                if reused:  # a pooled socket may have been closed by the server meanwhile
                    resp.peek_alive()
                return resp
            except (OSError, HTTPError) as exc:
                sock.close()
                if not reused:
                    raise HTTPError(f"request to {self.host}:{self.port} failed: {exc}") from exc
        raise HTTPError("unreachable")  # pragma: no cover


class Response:
    """One response; read the head, then the body whole or piece by piece."""

    def __init__(self, pool: Pool, sock: socket.socket, timeout: float) -> None:
        self.pool, self.sock, self.timeout = pool, sock, timeout
        self.buf = bytearray()
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.done = False
        self._chunked = False
        self._left: int | None = None   # bytes left in the current chunk / the whole body
        self._need_crlf = False
        self._reusable = True
        self._closed = False

    def _recv(self, timeout: float | None) -> bytes | None:
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(65536)
        except socket.timeout:
            return None
        except OSError as exc:
            raise HTTPError(f"connection to the engine failed: {exc}") from exc

    def peek_alive(self) -> None:
        """Raise HTTPError if a reused connection was closed by the server before answering."""
        self.sock.settimeout(0.0)
        try:
            data = self.sock.recv(65536, socket.MSG_PEEK)
            if data == b"":
                raise HTTPError("stale keep-alive connection")
        except (BlockingIOError, socket.timeout):
            pass
        except OSError as exc:
            raise HTTPError(str(exc)) from exc

    def head(self, timeout: float | None = None) -> bool:
        """Read status line and headers; False if `timeout` passed first (call again later)."""
        if self.status is not None:
            return True
        while b"\r\n\r\n" not in self.buf:
            data = self._recv(timeout if timeout is not None else self.timeout)
            if data is None:
                return False
            if not data:
                raise HTTPError("engine closed the connection before answering")
            self.buf += data
        raw, _, rest = bytes(self.buf).partition(b"\r\n\r\n")
        self.buf = bytearray(rest)
        lines = raw.decode("latin-1").split("\r\n")
        try:
            self.status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            raise HTTPError(f"malformed status line {lines[0]!r}") from None
        for line in lines[1:]:
            k, _, v = line.partition(":")
            self.headers[k.strip().lower()] = v.strip()
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        if not self._chunked:
            cl = self.headers.get("content-length")
            self._left = int(cl) if cl is not None else None
            if self._left == 0:
                self.done = True
        if self.headers.get("connection", "").lower() == "close" or (self._left is None and not self._chunked):
            self._reusable = False
        return True

    def _decode(self) -> bytes:
        out = bytearray()
        buf = self.buf
        if not self._chunked:
            take = len(buf) if self._left is None else min(self._left, len(buf))
            out += buf[:take]
            del buf[:take]
            if self._left is not None:
                self._left -= take
                self.done = self._left == 0
            return bytes(out)
        while not self.done:
            if self._need_crlf:
                if len(buf) < 2:
                    break
                del buf[:2]
                self._need_crlf = False
            if not self._left:
                end = buf.find(b"\r\n")
                if end < 0:
                    break
                size = int(bytes(buf[:end]).split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    trailer_end = buf.find(b"\r\n\r\n", end) if buf[end + 2:end + 4] != b"\r\n" else end
                    if trailer_end < 0:
                        break
                    del buf[:trailer_end + 4]
                    self.done = True
                    break
                del buf[:end + 2]
                self._left = size
            take = min(self._left, len(buf))
            if take == 0:
                break
            out += buf[:take]
            del buf[:take]
            self._left -= take
            if self._left == 0:
                self._need_crlf = True
        return bytes(out)

    def read_some(self, timeout: float | None) -> bytes | None:
        """Next decoded body bytes; b"" at the end of the body; None when `timeout` passed."""
        while True:
            out = self._decode()
            if out or self.done:
                if self.done and not out:
                    self._finish()
                return out
            data = self._recv(timeout)
            if data is None:
                return None
            if not data:
                self._reusable = False
                if self._chunked or self._left:
                    raise HTTPError("engine closed the connection mid-body")
                self.done = True
                self._finish()
                return b""
            self.buf += data

    def read_all(self) -> bytes:
        out = bytearray()
        while True:
            piece = self.read_some(self.timeout)
            if piece is None:
                self.close()
                raise HTTPError("timed out reading the engine's answer")
            if not piece:
                return bytes(out)
            out += piece

    def _finish(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reusable and not self.buf:
            self.pool.release(self.sock)
        else:
            self.sock.close()

    def close(self) -> None:
        """Abandon the response (closing the socket makes the engine abort the request)."""
        if not self._closed:
            self._closed = True
            if self.done and self._reusable and not self.buf:
                self.pool.release(self.sock)
            else:
                self.sock.close()
