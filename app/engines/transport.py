"""The engine client's non-stream transport: httpcore connections that watch for a departed caller.

What ``app.engines.client`` needs below httpx's public surface (streams are
``app.engines.stream``'s own sockets):

* ``watching(idle, every)`` + ``WatchedStream``: a read that finds nothing to read waits in
  slices and calls ``idle()`` between them, so a non-stream call notices that *its* caller left
  (the gateway's client closed) and abandons the request, which closes the connection and makes
  the engine abort generation.  Built as an httpcore network backend
  (https://www.encode.io/httpcore/network-backends/) installed into httpx's transport
  (``watched_transport``; httpx 0.28 sends every request of an ``HTTPTransport`` through its
  private ``_pool``, the one place this module reaches into httpx internals).
"""
from __future__ import annotations

import contextlib
import select
import threading
import time
from typing import Any, Callable, Iterator

import httpcore
import httpx

_watch = threading.local()  # (idle, every): set by `watching` on the thread doing the read


@contextlib.contextmanager
def watching(idle: Callable[[], None] | None, every: float) -> Iterator[None]:
    """While active on this thread, a read from an engine connection that finds nothing to read
    waits in slices of ``every`` seconds and calls ``idle()`` between them; an exception raised by
    ``idle`` abandons the call (httpcore then closes the connection, so the engine sees the client
    leave and aborts the request)."""
    previous = getattr(_watch, "current", None)
    _watch.current = (idle, every) if idle is not None else None
    try:
        yield
    finally:
        _watch.current = previous


class WatchedStream(httpcore.NetworkStream):
    """An engine connection (httpcore's plain socket stream) whose reads honour ``watching``.

    Writes are held until the connection next reads (or closes): httpcore writes a request's
    head and body separately, and two segments wake the engine twice (it reads the head, then
    waits for the body); held, a request leaves as one ``sendall``.
    """

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner
        self._held: list[bytes] = []
        self._held_timeout: float | None = None
        sock = inner.get_extra_info("socket")
        self._poll = select.poll() if sock is not None else None  # poll: no FD_SETSIZE limit
        if self._poll is not None:
            self._poll.register(sock, select.POLLIN | select.POLLPRI)

    def _flush(self) -> None:
        if self._held:
            data, self._held = b"".join(self._held), []
            self._inner.write(data, self._held_timeout)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self._flush()
        watch = getattr(_watch, "current", None)
        if watch is not None and self._poll is not None:
            idle, every = watch
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._poll.poll(0 if every <= 0 else max(1, int(every * 1000))):
                idle()
                if deadline is not None and time.monotonic() >= deadline:
                    raise httpcore.ReadTimeout("timed out")
        return self._inner.read(max_bytes, timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if buffer:
            self._held.append(buffer)
            self._held_timeout = timeout

    def close(self) -> None:
        self._held = []
        self._inner.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> httpcore.NetworkStream:
        self._flush()
        return self._inner.start_tls(ssl_context, server_hostname, timeout)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class WatchedBackend(httpcore.SyncBackend):
    def connect_tcp(self, *args, **kwargs) -> httpcore.NetworkStream:
        return WatchedStream(super().connect_tcp(*args, **kwargs))


def watched_transport(base_url: str, *, max_keepalive: int, socket_options: list) -> httpx.HTTPTransport:
    """An httpx transport to ``base_url`` (``http://`` or ``https://``) whose connections are
    ``WatchedStream``s: same limits and socket options as ``httpx.HTTPTransport``; unlimited
    connections, ``max_keepalive`` idle ones kept.  A plain-http engine never uses TLS, so the CA
    bundle is loaded only for ``https://`` (~0.1 s per process)."""
    https = base_url.startswith("https://")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max_keepalive)
    transport = httpx.HTTPTransport(verify=https, limits=limits, socket_options=socket_options)
    # Same pool, on connections whose reads honour `watching`; httpx 0.28's HTTPTransport sends
    # every request through its `_pool`.
    transport._pool = httpcore.ConnectionPool(
        ssl_context=httpx.create_ssl_context(verify=True) if https else None,
        max_connections=limits.max_connections, max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry, socket_options=socket_options,
        network_backend=WatchedBackend())
    return transport
