"""Has the HTTP client of this request gone?  One probe for the servers that answer a
non-stream request only when it is done (the embedded engine, the gateway).

A streamed answer notices a departed client when a write fails; a non-stream answer writes
nothing until the end, so the server looks at the client's socket instead: readable with
nothing to read (EOF) means the client closed it.  vLLM does the same for its non-stream
routes (`with_cancellation`, https://github.com/vllm-project/vllm/blob/main/vllm/entrypoints/utils.py).
"""
from __future__ import annotations

import select
import socket
from typing import Callable


def client_gone_probe(environ: dict) -> Callable[[], bool]:
    """A function telling whether the client has closed its connection: EOF on the socket that
    gunicorn (`gunicorn.socket`) or werkzeug's server (`werkzeug.socket`) put in the WSGI
    environ; always False where no socket is known (a test client).  Each call costs one
    `poll` with no wait, plus a `recv(MSG_PEEK)` when the socket is readable."""
    sock = environ.get("gunicorn.socket") or environ.get("werkzeug.socket")
    if sock is None:
        return lambda: False
    poller = select.poll()  # poll, not select: no FD_SETSIZE (1024) limit on busy servers
    poller.register(sock, select.POLLIN | select.POLLPRI)

    def gone() -> bool:
        try:
            if not poller.poll(0):
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except (OSError, ValueError):
            return True
    return gone
