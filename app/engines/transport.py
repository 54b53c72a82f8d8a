"""The engine client's transport: httpcore connections that watch for a departed caller, and the
reader threads that read streams.

Two jobs ``app.engines.client`` needs below httpx's public surface:

* ``watching(idle, every)`` + ``WatchedStream``: a read that finds nothing to read waits in
  slices and calls ``idle()`` between them, so a non-stream call notices that *its* caller left
  (the gateway's client closed) and abandons the request, which closes the connection and makes
  the engine abort generation.  Built as an httpcore network backend
  (https://www.encode.io/httpcore/network-backends/) installed into httpx's transport
  (``watched_transport``; httpx 0.28 sends every request of an ``HTTPTransport`` through its
  private ``_pool``, the one place this module reaches into httpx internals).
* ``READERS``: daemon threads reused from stream to stream (``ReaderPool``).

``shutdown(response)`` drops a streamed response's connection from another thread.
"""
from __future__ import annotations

import contextlib
import os
import queue
import select
import socket
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


class ReaderPool:
    """Daemon threads reused from stream to stream.  A new thread per stream costs a scheduler
    round trip on the request's path (``Thread.start`` waits until the thread runs), which on a
    loaded box is milliseconds; an idle reader is handed the next stream without that wait.
    Threads are never stopped (their number is the peak of concurrent streams); daemon, so a
    reader blocked on a silent engine never holds up interpreter exit."""

    def __init__(self) -> None:
        self._reset()
        # A forked child has none of the parent's threads: it starts with an empty pool.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable, *args: Any) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        self._tasks.put((fn, args))
        if spawn:  # every queued task has a thread waiting for it: an idle one, or this new one
            threading.Thread(target=self._run, daemon=True, name="engine-stream").start()

    def _run(self) -> None:
        while True:
            fn, args = self._tasks.get()
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a reader reports its own failures; keep the thread
                pass
            with self._lock:
                self._idle += 1


READERS = ReaderPool()  # the process's one pool, shared by every client


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


def shutdown(response: httpx.Response) -> None:
    """Shut down the connection under a streamed ``response`` (its ``network_stream`` extension)
    so a reader blocked in ``recv`` on it wakes at once and the engine sees the client leave;
    a response without a socket, or one already closed, is left alone."""
    stream = response.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
