"""The engine client's transport (`app.engines.transport`): held writes on a real socket pair, and
the reader pool across a fork, against the scripted engine."""
from __future__ import annotations


from app.conformance.scripted import directive
from app.engines.client import DONE, EngineClient


def test_engine_connection_sends_a_request_in_one_write():
    """httpcore writes a request's head and body separately; the engine connection holds writes
    until it next reads, so the engine gets the request in one segment (one wakeup)."""
    import socket as socket_mod

    from app.engines.transport import HeldWriteStream

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
    stream = HeldWriteStream(inner)
    stream.write(b"POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\n")
    stream.write(b"{}")
    assert inner.writes == []
    inner.b.sendall(b"HTTP/1.1 200 OK\r\n")
    assert stream.read(100) == b"HTTP/1.1 200 OK\r\n"
    assert inner.writes == [b"POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"]
    stream.close()


def test_streams_work_in_a_forked_child_without_the_parents_connections(scripted_engine):
    """Finished streams leave their connection in the client's pool; a child forked after that (a
    Celery prefork worker, a gunicorn worker) must not read from the parent's socket: its pool
    starts empty and its stream completes on a connection of its own."""
    import os

    with EngineClient(scripted_engine, timeout=10) as client:
        model = client.models()[0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": directive({"text": "ok"})}],
                "stream": True}
        # A stream's connection is kept only when the chunked body's terminator arrived with or
        # before [DONE]; on a loaded box it can come in a later read, after the stream was
        # closed (then the connection is closed, not pooled).  Stream until one is kept.
        for _ in range(20):
            assert list(client.chat(body["messages"], stream=True, model=model))
            if client._streams.pool._idle:
                break
        assert len(client._streams.pool._idle) == 1  # kept for the next stream
        parent_port = client._streams.pool._idle[0].getsockname()[1]
        pid = os.fork()
        if pid == 0:  # child: exit 0 only if its stream completes on a new connection
            code = 1
            try:
                stream = client.open_stream(body)
                port = stream._sock.getsockname()[1] if stream._sock is not None else -1
                items = []
                while stream.wait(3) and stream.error is None and (not items or items[-1] is not DONE):
                    items += stream.poll(3) or []
                code = 0 if items and items[-1] is DONE and port != parent_port else 1
                stream.close()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert list(client.chat(body["messages"], stream=True, model=model))  # the parent's socket still works
