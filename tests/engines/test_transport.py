"""The engine client's transport (`app.engines.transport`): held writes on a real socket pair, and
the reader pool across a fork, against the scripted engine."""
from __future__ import annotations

import time

from app.conformance.scripted import directive
from app.engines.client import EngineClient


def test_engine_connection_sends_a_request_in_one_write():
    """httpcore writes a request's head and body separately; the engine connection holds writes
    until it next reads, so the engine gets the request in one segment (one wakeup)."""
    import socket as socket_mod

    from app.engines.transport import WatchedStream

    class Inner:
        def __init__(self):
            self.writes, self.a, self.b = [], *socket_mod.socketpair()

        def write(self, buffer, timeout=None):
            self.writes.append(buffer)
            self.a.sendall(buffer)

        def read(self, max_bytes, timeout=None):
            return self.a.recv(max_bytes)

        def close(self):
            self.a.close()
            self.b.close()

        def get_extra_info(self, info):
            return self.a if info == "socket" else None

    inner = Inner()
    stream = WatchedStream(inner)
    stream.write(b"POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\n")
    stream.write(b"{}")
    assert inner.writes == []
    inner.b.sendall(b"HTTP/1.1 200 OK\r\n")
    assert stream.read(100) == b"HTTP/1.1 200 OK\r\n"
    assert inner.writes == [b"POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"]
    stream.close()


def test_stream_readers_work_in_a_forked_child(scripted_engine):
    """Reader threads are reused; a child forked after streams were read (a Celery prefork worker,
    a gunicorn worker) has none of them and must start its own instead of queueing forever."""
    import os

    with EngineClient(scripted_engine, timeout=10) as client:
        model = client.models()[0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": directive({"text": "ok"})}],
                "stream": True}
        assert list(client.chat(body["messages"], stream=True, model=model))
    from app.engines import transport
    deadline = time.monotonic() + 2
    while transport.READERS._idle == 0 and time.monotonic() < deadline:  # the parent's reader is idle
        time.sleep(0.01)
    assert transport.READERS._idle > 0
    pid = os.fork()
    if pid == 0:  # child: a fresh client, one stream, exit 0 only if it completes
        code = 1
        try:
            with EngineClient(scripted_engine, timeout=5) as child:
                stream = child.open_stream(body)
                code = 0 if stream.wait(3) and stream.error is None else 1
                stream.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
