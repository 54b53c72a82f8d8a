"""The thread-free stream reader (`app.engines.stream`): HTTP/1.1 body framing undone per read,
connections kept and reused, a stale one retried, `close` from another thread, timeouts."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from app.engines.client import DONE, EOF, EngineClient, EngineConnectionError, EngineHTTPError
from app.engines.http1 import BodyReader


def _chunked(payload: bytes, sizes: list[int]) -> bytes:
    out, i = b"", 0
    for n in sizes:
        out += b"%x;ext=1\r\n%s\r\n" % (n, payload[i:i + n]) if n % 2 else b"%X\r\n%s\r\n" % (n, payload[i:i + n])
        i += n
    return out + b"0\r\nX-Trailer: 1\r\n\r\n"


def test_chunked_body_is_undone_whatever_the_reads():
    payload = "data: {\"a\": \"héllo\"}\n\n".encode() * 5
    wire = _chunked(payload, [7, 1, 40, len(payload) - 48])
    for step in (1, 2, 3, 5, 64, len(wire)):
        r = BodyReader("chunked")
        got = b"".join(r.feed(wire[i:i + step]) for i in range(0, len(wire), step))
        assert got == payload and r.complete and r.clean, step


@pytest.mark.parametrize("wire", [b"zz\r\n", b"+5\r\nhello\r\n", b"5\r\nhelloXX", b"1_0\r\n"])
def test_malformed_chunk_framing_is_an_error_after_the_good_payload(wire):
    """What came before the bad framing in the same read is still handed over (an engine's first
    chunk carries the prompt ids); the reader is broken from then on."""
    r = BodyReader("chunked")
    assert r.feed(b"3\r\nabc\r\n" + wire).startswith(b"abc") and r.broken
    with pytest.raises(ValueError):
        r.feed(b"1\r\nx\r\n")


def test_sized_body_and_bytes_after_the_end():
    r = BodyReader("length", 5)
    assert r.feed(b"hel") == b"hel" and not r.complete
    assert r.feed(b"loEXTRA") == b"lo" and r.complete and not r.clean


class _Raw:
    """A TCP server answering each request on a connection with the next scripted answer (bytes,
    or a callable given the socket); records how many connections it accepted.  `close_after`: a
    connection is closed after that many answers (else when the answers run out)."""

    def __init__(self, answers, close_after=None):
        self.answers = list(answers)
        self.close_after = close_after
        self.accepted = 0
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.srv.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._conn, args=(conn,), daemon=True).start()

    def _conn(self, conn):
        buf, served = b"", 0
        try:
            while self.answers and served != self.close_after:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                n = int([ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0])
                while len(buf) < n:
                    buf += conn.recv(65536)
                buf = buf[n:]
                answer = self.answers.pop(0)
                if callable(answer):
                    answer(conn)
                    return
                conn.sendall(answer)
                served += 1
        finally:
            conn.close()

    def close(self):
        self.srv.close()


def _sse(*objs, done=True) -> bytes:
    body = b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + (b"data: [DONE]\n\n" if done else b"")
    return body


def _ok(body: bytes, split=()) -> bytes:
    """A chunked 200 answer: chunks of the `split` sizes, then one with the rest."""
    sizes = [*split, len(body) - sum(split)]
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + \
        _chunked(body, sizes)


def _items(stream, timeout=5):
    items: list = []
    assert stream.wait(timeout)
    while not items or not (items[-1] in (DONE, EOF) or isinstance(items[-1], Exception)):
        got = stream.poll(timeout)
        assert got is not None, "the stream went silent"
        items += got
    return items


def test_streams_reuse_the_connection_and_retry_a_stale_one():
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
    server = _Raw([_ok(_sse(chunk, chunk), split=[3, 30, 1]), _ok(_sse(chunk))], close_after=2)
    try:
        with EngineClient(server.url, timeout=5) as client:
            s1 = client.open_stream({"stream": True})
            assert _items(s1)[-1] is DONE
            s1.close()
            s2 = client.open_stream({"stream": True})
            assert [i for i in _items(s2) if i is not DONE] == [chunk]
            s2.close()
            assert server.accepted == 1  # the second stream went over the first one's connection
            # The server closed that connection after its answers: the next stream notices
            # (stale in the pool, or EOF before any byte) and goes over a new connection.
            server.answers.append(_ok(_sse(chunk)))
            time.sleep(0.1)
            s3 = client.open_stream({"stream": True})
            assert _items(s3)[-1] is DONE and server.accepted == 2
            s3.close()
    finally:
        server.close()


def test_refusal_eof_without_done_and_bad_json():
    err = json.dumps({"error": {"message": "too long", "code": 400}}).encode()
    refusal = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(err), err)
    cut = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + _sse({"choices": []}, done=False)
    bad = _ok(b"data: {not json\n\n")
    server = _Raw([refusal, cut])
    try:
        with EngineClient(server.url, timeout=5) as client:
            s = client.open_stream({})
            assert s.wait(5) and isinstance(s.error, EngineHTTPError) and s.error.status == 400
            assert s.error.message == "too long"
            s.close()
            s = client.open_stream({})
            assert _items(s)[-1] is EOF
            s.close()
        server.answers.append(bad)
        with EngineClient(server.url, timeout=5) as client:
            s = client.open_stream({})
            assert isinstance(_items(s)[-1], ValueError)
            s.close()
    finally:
        server.close()


def test_close_from_another_thread_wakes_a_waiting_poll_and_the_engine_sees_it():
    seen = threading.Event()

    def silent(conn):  # the head, then nothing until the client leaves
        conn.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        conn.settimeout(60)  # longer than the client's silence limit: the client always leaves first
        try:
            if conn.recv(1) == b"":
                seen.set()
        except TimeoutError:
            pass
        except OSError:
            seen.set()

    server = _Raw([silent])
    try:
        with EngineClient(server.url, timeout=30) as client:
            s = client.open_stream({})
            assert s.wait(5) and s.error is None
            assert s.poll(0.1) is None  # the caller would send a keep-alive now
            threading.Timer(0.2, s.close).start()
            # No deadline of its own: only the close (or, failing it, the client's 30 s silence
            # limit, which ends the poll with a timed-out error) can end this poll.
            got = s.poll(None) or []
            assert not any(isinstance(i, EngineConnectionError) and i.timed_out for i in got), got
            assert s._cancelled and s._finished.is_set()
            assert seen.wait(30), "the engine did not see the connection close"
    finally:
        server.close()


def test_poll_zero_looks_without_waiting():
    """poll(0) hands out what has arrived and is None when nothing has; it never waits, and a
    look that found nothing leaves the stream readable (the next chunk is not lost)."""
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
    go = threading.Event()

    def frame(payload: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(payload), payload)

    def halting(conn):  # one chunk, then the rest once the test says so
        conn.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + frame(_sse(chunk, done=False)))
        go.wait(10)
        conn.sendall(frame(_sse(chunk)) + b"0\r\n\r\n")
        time.sleep(1)

    server = _Raw([halting])
    try:
        with EngineClient(server.url, timeout=30) as client:
            s = client.open_stream({})
            assert s.wait(5) and s.error is None
            assert s.poll(5) == [chunk]
            waits = []  # every wait on the socket a poll makes goes through _wait_io
            wait_io = s._wait_io
            s._wait_io = lambda *a: waits.append(a) or wait_io(*a)
            assert all(s.poll(0) is None for _ in range(100))
            assert waits == []  # a look: one non-blocking read each, never a wait on the socket
            s._wait_io = wait_io
            go.set()
            deadline, got = time.monotonic() + 5, None
            while got is None and time.monotonic() < deadline:
                got = s.poll(0)
            assert got == [chunk, DONE]
            s.close()
    finally:
        server.close()


def test_a_silent_engine_times_out_and_an_unreachable_one_fails_at_once():
    leave = threading.Event()
    server = _Raw([lambda conn: leave.wait(60)])  # silent until the test is done with it
    try:
        with EngineClient(server.url, timeout=0.5) as client:
            s = client.open_stream({})
            # `timed_out` is only set by the client's own silence limit; the server never closes first.
            assert s.wait(None) and isinstance(s.error, EngineConnectionError) and s.error.timed_out
    finally:
        leave.set()
        server.close()
    with EngineClient("http://127.0.0.1:1", timeout=2) as client:
        s = client.open_stream({})
        # refused at connect ("unreachable"), not given up on at the 2 s limit (timed out)
        assert s.wait(None) and "unreachable" in str(s.error) and not s.error.timed_out
    with EngineClient("http://127.0.0.1:1", timeout=2) as client, pytest.raises(ValueError, match="header"):
        client.open_stream({}, headers={"X-Bad": "a\r\nInjected: 1"})


def test_a_host_name_is_resolved_and_each_of_its_addresses_tried():
    """`localhost` may resolve to ::1 first while the engine listens on 127.0.0.1 only."""
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
    server = _Raw([_ok(_sse(chunk))])
    try:
        with EngineClient(server.url.replace("127.0.0.1", "localhost"), timeout=5) as client:
            s = client.open_stream({"stream": True})
            assert _items(s)[-1] is DONE
            s.close()
    finally:
        server.close()


@pytest.mark.parametrize("text", ['{"a": [1, 2.5, null, "é"]}', ' {"a":1}', '{"a":1} ', '{"a":1}x', '', '[1,',
                                  'NaN', '{"a":1}{"b":2}', '"\\ud800"', '1e999', '-Infinity',
                                  '{"id": 18446744073709551615, "x": 0.1234567890123456789012}'])
def test_chunk_json_is_read_as_json_loads_reads_it(text):
    from app.engines.stream import loads_json
    try:
        want = json.loads(text)
    except ValueError as exc:
        with pytest.raises(ValueError) as got:
            loads_json(text)
        assert type(got.value) is type(exc)
        return
    got = loads_json(text)
    assert got == want or (got != got and want != want)
    assert repr(got) == repr(want)  # the same types too (an integer stays an integer)


def test_chunk_json_integers_beyond_64_bits_become_the_nearest_float():
    """orjson's one difference from json.loads (documented on `loads_json`)."""
    from app.engines.stream import loads_json
    got = loads_json('[18446744073709551616, -9223372036854775809, 18446744073709551615]')
    assert got == [float(2**64), float(-2**63 - 1), 2**64 - 1] and isinstance(got[2], int)


def _json_answer(obj, chunked_sizes=None) -> bytes:
    body = json.dumps(obj).encode()
    if chunked_sizes is not None:
        return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
                + _chunked(body, [*chunked_sizes, len(body) - sum(chunked_sizes)]))
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def test_a_whole_answer_sized_or_chunked_on_one_kept_connection_then_a_stale_one_retried():
    """`complete` reads a non-stream answer on the streams' sockets: a sized body and a chunked one
    split across reads come back whole and parsed, over one connection; when the engine has closed
    it, the next call goes over a new one."""
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "héllo"}}]}

    def in_pieces(conn):  # a chunked answer in three writes, then the connection stays open
        raw = _json_answer(answer, chunked_sizes=[5, 17])
        for k in range(0, len(raw), 40):
            conn.sendall(raw[k:k + 40])
            time.sleep(0.01)
        time.sleep(0.3)

    server = _Raw([_json_answer(answer), _json_answer(answer)], close_after=2)
    try:
        with EngineClient(server.url, timeout=5) as client:
            assert client.complete({"messages": []}) == answer
            assert client.complete({"messages": []}) == answer
            assert server.accepted == 1
            server.answers.append(in_pieces)
            time.sleep(0.1)  # the server closed the first connection after its two answers
            assert client.complete({"messages": []}) == answer
            assert server.accepted == 2
    finally:
        server.close()


def test_a_whole_answer_cut_short_not_json_or_refused():
    """A body that ends before its Content-Length is a connection error (never a truncated
    answer); a body that is not JSON comes back as its text; a 4xx is the engine's HTTP error with
    its parsed body."""
    err = json.dumps({"error": {"message": "context too long", "code": 400}}).encode()
    refusal = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(err), err)
    text = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n\r\nhello"

    def cut(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"choices\": [")

    server = _Raw([refusal, text, cut])
    try:
        with EngineClient(server.url, timeout=5) as client:
            with pytest.raises(EngineHTTPError) as refused:
                client.complete({"messages": []})
            assert refused.value.status == 400 and refused.value.message == "context too long"
            assert client.complete({"messages": []}) == "hello"
            with pytest.raises(EngineConnectionError, match="before the whole answer"):
                client.complete({"messages": []})
            assert client._streams.pool._idle == []  # the cut connection is never kept
    finally:
        server.close()
