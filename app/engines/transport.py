"""The engine client's httpx transport: httpcore connections that send a request in one write.

httpcore writes a request's head and body separately, and two segments wake the engine twice
(it reads the head, then waits for the body).  ``HeldWriteStream`` holds writes until the
connection next reads (or closes), so a request leaves as one ``sendall``.  Built as an httpcore
network backend (https://www.encode.io/httpcore/network-backends/) installed into httpx's
transport (``one_write_transport``; httpx 0.28 sends every request of an ``HTTPTransport``
through its private ``_pool``, the one place this module reaches into httpx internals).

Chat completions do not come here: ``app.engines.stream`` reads them on its own sockets.
"""
from __future__ import annotations

from typing import Any

import httpcore
import httpx


class HeldWriteStream(httpcore.NetworkStream):
    """An engine connection (httpcore's plain socket stream) whose writes are held until it next
    reads, starts TLS or closes, then sent as one."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner
        self._held: list[bytes] = []
        self._held_timeout: float | None = None

    def _flush(self) -> None:
        if self._held:
            data, self._held = b"".join(self._held), []
            self._inner.write(data, self._held_timeout)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self._flush()
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


class HeldWriteBackend(httpcore.SyncBackend):
    def connect_tcp(self, *args, **kwargs) -> httpcore.NetworkStream:
        return HeldWriteStream(super().connect_tcp(*args, **kwargs))


def one_write_transport(base_url: str, *, max_keepalive: int, socket_options: list) -> httpx.HTTPTransport:
    """An httpx transport to ``base_url`` (``http://`` or ``https://``) whose connections are
    ``HeldWriteStream``s: same limits and socket options as ``httpx.HTTPTransport``; unlimited
    connections, ``max_keepalive`` idle ones kept.  A plain-http engine never uses TLS, so the CA
    bundle is loaded only for ``https://`` (~0.1 s per process)."""
    https = base_url.startswith("https://")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max_keepalive)
    transport = httpx.HTTPTransport(verify=https, limits=limits, socket_options=socket_options)
    # Same pool, on connections that hold their writes; httpx 0.28's HTTPTransport sends every
    # request through its `_pool`.
    transport._pool = httpcore.ConnectionPool(
        ssl_context=httpx.create_ssl_context(verify=True) if https else None,
        max_connections=limits.max_connections, max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry, socket_options=socket_options,
        network_backend=HeldWriteBackend())
    return transport
