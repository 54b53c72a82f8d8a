"""Waiting for one socket to become readable, on a plain thread or in a gevent greenlet.

``readable_waiter(sock)`` gives the object a stream waits on: ``poll(ms)`` is true once the
socket is readable within ``ms`` ms (-1: no limit).  On a plain thread that is a
``select.poll`` with the socket registered; in a process whose ``select`` gevent has
monkey-patched (the gevent gateway worker) it is ``HubWait``, a watcher on gevent's own loop.
``release_waiter`` lets such a watcher go before its socket is closed, pooled or replaced.
"""
from __future__ import annotations

import select
import socket
import sys


def gevent_select() -> bool:
    """True in a process whose `select` module gevent has monkey-patched (a gevent gateway worker)."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and monkey.is_module_patched("select")


def readable_waiter(sock: socket.socket) -> "select.poll | HubWait":
    """What to wait on for ``sock`` to be readable: ``HubWait`` under gevent, else a ``select.poll``
    with ``sock`` registered for ``POLLIN | POLLPRI``."""
    if gevent_select():
        return HubWait(sock)
    waiter = select.poll()
    waiter.register(sock, select.POLLIN | select.POLLPRI)
    return waiter


def release_waiter(waiter: "select.poll | HubWait | None") -> None:
    """Release a gevent watcher (a ``select.poll`` holds nothing to release); a closed one answers
    every later wait at once, as ``select.poll`` does for a closed socket."""
    if isinstance(waiter, HubWait):
        waiter.close()


class _WaitClosed(Exception):
    """Thrown into a greenlet waiting in `HubWait.poll` when another greenlet closes the stream."""


class HubWait:
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
