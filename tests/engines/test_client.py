"""The engine client against real HTTP servers: the scripted engine and a small server that writes
the event-stream forms the WHATWG spec allows
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation)."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.conformance import scripted
from app.engines.client import DONE, EOF, EngineClient, EngineConnectionError, EngineHTTPError
from support import wait_for


class _SpecServer(BaseHTTPRequestHandler):
    """Streams chat chunks as `data:{json}` (no space), CRLF line ends, comments, one TCP write
    per byte for the first event; or answers an error."""

    def log_message(self, *args) -> None:
        pass

    # GET /v1/policy_version answers `policy_answer`: what an engine that is not ours may send.
    ANSWERS = {"html": (b"<html>proxy error page</html>", "text/html"),
               "list": (b"[1, 2]", "application/json"),
               "no-version": (b'{"weights": "x"}', "application/json"),
               "unnamed": (b'{"policy_version": 4}', "application/json")}
    policy_answer = "unnamed"

    def do_GET(self) -> None:
        data, kind = self.ANSWERS[self.policy_answer]
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if body.get("fail"):
            data = json.dumps({"error": {"message": "no such model", "code": 404}}).encode()
            self.send_response(404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        chunks = [{"choices": [{"index": 0, "delta": {"content": t}}]} for t in ("héllo", " wörld")]
        first = b"data:" + json.dumps(chunks[0], ensure_ascii=False).encode() + b"\r\n\r\n"
        for i in range(len(first)):
            self.wfile.write(first[i:i + 1])
            self.wfile.flush()
        self.wfile.write(b": keep-alive\r\n\r\n")
        self.wfile.write(b"data:" + json.dumps(chunks[1], ensure_ascii=False).encode() + b"\r\n\r\n")
        if not body.get("no_done"):
            self.wfile.write(b"data:[DONE]\r\n\r\n")


@pytest.fixture(scope="module")
def spec_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SpecServer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_stream_parses_data_without_space_and_crlf(spec_server):
    with EngineClient(spec_server, timeout=10) as client:
        chunks = list(client.chat([{"role": "user", "content": "hi"}], stream=True))
        assert [c["choices"][0]["delta"]["content"] for c in chunks] == ["héllo", " wörld"]
        with pytest.raises(EngineConnectionError, match="before \\[DONE\\]"):
            list(client.chat([], stream=True, no_done=True))
        with pytest.raises(EngineHTTPError) as err:
            list(client.chat([], stream=True, fail=True))
        assert err.value.status == 404 and err.value.message == "no such model"


def test_open_stream_polls_items_and_reports_refusal(scripted_engine):
    with EngineClient(scripted_engine, timeout=10) as client:
        model = client.models()[0]["id"]
        assert client.models()[0]["max_model_len"] > 0
        body = {"model": model, "messages": [{"role": "user", "content": scripted.directive({"text": "abc def"})}],
                "stream": True, "return_token_ids": True}
        stream = client.open_stream(body, headers={"X-Turnstile-Episode": "7"})
        assert stream.wait(5) and stream.error is None and stream.status == 200
        items: list = []
        while not items or items[-1] not in (DONE, EOF):
            items += stream.poll(5) or []
        stream.close()
        assert items[-1] is DONE and "".join(i["choices"][0]["delta"].get("content") or ""
                                             for i in items[:-1] if i["choices"]) == "abc def"
        refused = client.open_stream({**body, "model": "nope"})
        assert refused.wait(5) and isinstance(refused.error, EngineHTTPError) and refused.error.status == 404
        refused.close()


def test_close_during_a_silent_engine_ends_the_reader_at_once(scripted_engine):
    """The engine sent its headers and then prefills in silence; closing the stream shuts the
    connection (so the engine sees the client leave) and the stream is finished when `close`
    returns, not when the engine would have answered."""
    with EngineClient(scripted_engine, timeout=30) as client:
        model = client.models()[0]["id"]
        client.request("POST", "/_scripted/reset", {})
        body = {"model": model, "stream": True,
                "messages": [{"role": "user", "content": scripted.directive({"text": "late", "prefill_delay": 60})}]}
        stream = client.open_stream(body)
        assert stream.wait(5) and stream.error is None
        assert stream.poll(0.2) is None  # nothing yet: the caller would send a keep-alive
        stream.close()
        assert stream._finished.is_set()  # close itself shut the socket: nothing waited on the engine
        # the engine saw the client leave before it answered (an answer sent in full is no abort)
        wait_for(lambda: client.request("GET", "/_scripted/aborted")["aborted"], 30, interval=0.02,
                 what="the engine to see the client leave")


def test_complete_reuses_its_connection_and_reports_refusal(scripted_engine):
    """A non-stream call with an idle hook: the answer whole, the connection back in the pool (the
    next call's engine socket is the same), no thread started, a refusal as the engine's HTTP error."""
    with EngineClient(scripted_engine, timeout=10) as client:
        model = client.models()[0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": scripted.directive({"text": "abc def"})}],
                "return_token_ids": True}
        kept, threads = [], []
        for _ in range(2):
            answer = client.complete(body, idle=lambda: None, idle_s=0.05)
            assert answer["choices"][0]["message"]["content"] == "abc def"
            assert answer["choices"][0]["token_ids"] == scripted.encode("abc def")
            threads.append(threading.active_count())  # the in-process engine serves each connection on a thread
            kept.append(list(client._streams.pool._idle))
        assert threads[1] == threads[0]  # the client started none, and the engine no second connection
        assert len(kept[0]) == 1 and kept[1] == kept[0]  # one connection, back in the pool after each call
        with pytest.raises(EngineHTTPError) as err:
            client.complete({**body, "model": "nope"}, idle=lambda: None)
        assert err.value.status == 404


@pytest.mark.parametrize("phase", ["header_delay", "token_delay"])
def test_complete_idle_hook_runs_while_the_engine_is_silent_and_its_error_aborts_the_request(
        scripted_engine, phase):
    """While a non-stream answer is being generated (the engine says nothing: before its head, or
    through its token delays), `idle` runs every `idle_s`; what it raises reaches the caller and
    the engine sees the connection close."""
    class Leave(Exception):
        pass

    calls = []

    def idle():
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise Leave()

    with EngineClient(scripted_engine, timeout=30) as client:
        model = client.models()[0]["id"]
        client.request("POST", "/_scripted/reset", {})
        reply = {"text": "x" * 40, phase: 5 if phase == "header_delay" else 0.5}
        body = {"model": model, "messages": [{"role": "user", "content": scripted.directive(reply)}]}
        with pytest.raises(Leave):
            client.complete(body, idle=idle, idle_s=0.05)
        assert len(calls) == 3
        # It left mid-answer, not after it: the engine, still generating, saw the connection close.
        wait_for(lambda: client.request("GET", "/_scripted/aborted")["aborted"], 30, interval=0.02,
                 what="the engine to see the client leave")


def test_unreachable_engine_and_health_timeout():
    with EngineClient("http://127.0.0.1:1", timeout=2) as client:
        with pytest.raises(EngineConnectionError, match="unreachable"):
            client.policy_version()
        stream = client.open_stream({"messages": []})
        assert stream.wait(5) and isinstance(stream.error, EngineConnectionError)
        with pytest.raises(TimeoutError):
            client.health(wait_s=0.3)


def test_serving_reads_version_and_weights_name_or_says_the_answer_is_not_one(spec_server, monkeypatch):
    """`serving()` of an answer that is not a policy version (a proxy's HTML page, a list, an object
    without the version) is a ValueError its callers catch, never an AttributeError; an engine that
    names no weights gives None."""
    with EngineClient(spec_server, timeout=5) as client:
        for kind in ("html", "list", "no-version"):
            monkeypatch.setattr(_SpecServer, "policy_answer", kind)
            with pytest.raises(ValueError, match="not a policy version"):
                client.serving()
        monkeypatch.setattr(_SpecServer, "policy_answer", "unnamed")
        assert client.serving() == (4, None)
