"""Where a client's chat streams go, and the engine connections it keeps between them.

``Target`` is one engine URL split into what a socket needs (scheme, host, port, the request
path) with the client's timeouts and its ``SocketPool``: connections whose answer was read to its
end, kept for the next call.  A kept connection the engine closed while it sat idle is noticed
before reuse (it reads as readable); a forked child starts with an empty pool.
"""
from __future__ import annotations

import os
import select
import socket
import ssl
import threading
from urllib.parse import urlsplit


class Target:
    """Where a client's streams go: ``base_url`` split into (scheme, host, port, path prefix).

    Raises:
        ValueError: ``base_url`` is not ``http(s)://host[:port][/prefix]``.
    """

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

    def connect(self) -> socket.socket:
        """A new TCP connection to the engine, Nagle off (``socket.create_connection``: every address
        the name resolves to, IPv4 or IPv6, within the connect timeout).

        Raises:
            OSError: refused, unresolvable or timed out.
        """
        sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

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
                close_quietly(sock)
        return None

    def give(self, sock: socket.socket) -> None:
        with self._lock:
            if self._pid == os.getpid() and len(self._idle) < self.keep:
                self._idle.append(sock)
                return
        close_quietly(sock)

    def clear(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            close_quietly(sock)


def close_quietly(sock: socket.socket) -> None:
    """``sock.close()``; an ``OSError`` from it is dropped (the connection is gone either way)."""
    try:
        sock.close()
    except OSError:
        pass
