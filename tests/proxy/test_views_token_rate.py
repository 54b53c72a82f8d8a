"""Streams at token rate: an engine read that carries many events is relayed in one write, and
every client still gets every event whole and in order (real SDKs); a client that reads one byte a
second back-pressures the engine instead of growing the gateway's memory."""
from __future__ import annotations

import json
import socket
import socketserver
import threading
import time

import pytest
from support import read_http_request, wait_for
from support.gateway import completions, free_port, start_gateway, stop, wait_http
from support.gateway_calls import auth_headers, request_for

from app.conformance.scripted import directive, encode

pytestmark = pytest.mark.both_worker_classes  # the relay's reads and writes differ most between them

# One token per character: 700 events, sent by the engine without pauses, so the gateway reads
# many of them per network read and writes them on together.
BURST = "".join(chr(0x61 + i % 26) for i in range(600)) + " wörld ✓ — 你好" * 10


def _deltas_in_order(deltas: list[str]) -> None:
    assert "".join(deltas) == BURST
    assert len(deltas) == len(BURST), "events were merged or split"  # one text event per engine token


def test_openai_sdk_chat_gets_every_event_whole_and_in_order(sdk, episode):
    ep, token = episode
    client = sdk.openai(token)
    deltas = [c.choices[0].delta.content for c in client.chat.completions.create(
        model="m", stream=True, max_tokens=2000, messages=[{"role": "user", "content": directive({"text": BURST})}])
        if c.choices and c.choices[0].delta.content]
    _deltas_in_order(deltas)
    [rec] = completions(ep)
    assert rec.sampled_ids == encode(BURST) and not rec.partial
    assert [api for api, _ in sdk.validated()] == ["chat"]


def test_openai_sdk_responses_gets_every_event_whole_and_in_order(sdk, episode):
    ep, token = episode
    client = sdk.openai(token)
    events = list(client.responses.create(model="m", stream=True, max_output_tokens=2000,
                                          input=directive({"text": BURST})))
    _deltas_in_order([e.delta for e in events if e.type == "response.output_text.delta"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    [rec] = completions(ep)
    assert rec.sampled_ids == encode(BURST)
    assert [api for api, _ in sdk.validated()] == ["responses"]


def test_anthropic_sdk_gets_every_event_whole_and_in_order(sdk, episode):
    ep, token = episode
    client = sdk.anthropic(token)
    deltas = []
    with client.messages.stream(model="claude-turnstile", max_tokens=2000,
                                messages=[{"role": "user", "content": directive({"text": BURST})}]) as s:
        for ev in s:
            if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                deltas.append(ev.delta.text)
    _deltas_in_order(deltas)
    [rec] = completions(ep)
    assert rec.sampled_ids == encode(BURST)
    assert [api for api, _ in sdk.validated()] == ["anthropic"]


def test_gemini_sdk_gets_every_event_whole_and_in_order(sdk, episode):
    from google.genai import types
    ep, token = episode
    client = sdk.gemini(token)
    deltas = []
    for r in client.models.generate_content_stream(
            model="gemini-2.5-pro", contents=[types.Content(role="user", parts=[types.Part(text=directive(
                {"text": BURST}))])], config=types.GenerateContentConfig(max_output_tokens=2000)):
        for cand in r.candidates or []:
            deltas += [p.text for p in (cand.content.parts if cand.content and cand.content.parts else []) if p.text]
    _deltas_in_order(deltas)
    [rec] = completions(ep)
    assert rec.sampled_ids == encode(BURST)
    assert [api for api, _ in sdk.validated()] == ["gemini"]


def _rss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return total


class FloodEngine(socketserver.BaseRequestHandler):
    """An engine that streams 200,000 one-token chunks (~50 MB) as fast as its socket takes them,
    and notes when the gateway closed the request (`left`)."""

    left: list[float] = []
    MODELS = b'{"object":"list","data":[{"id":"flood","object":"model","max_model_len":1000000}]}'

    def handle(self) -> None:
        request = read_http_request(self.request)
        if request is None:
            return
        head, body = request
        if head.startswith(b"GET"):
            self.request.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                 b"connection: close\r\n\r\n%s" % (len(self.MODELS), self.MODELS))
            return
        first = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "flood", "prompt_token_ids": [5],
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        tok = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "flood",
               "choices": [{"index": 0, "delta": {"content": "y"}, "token_ids": [6], "finish_reason": None,
                            "logprobs": {"content": [{"token": "y", "logprob": -0.5, "bytes": [121],
                                                      "top_logprobs": []}]}}]}

        def chunk(obj) -> bytes:
            data = b"data: " + json.dumps(obj).encode() + b"\n\n"
            return b"%x\r\n%s\r\n" % (len(data), data)
        try:
            self.request.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n" + chunk(first))
            block = chunk(tok) * 100
            for _ in range(2000):
                self.request.sendall(block)
        except OSError:
            FloodEngine.left.append(time.time())


@pytest.fixture(scope="module")
def flood_gateway(gw_stack, tmp_path_factory):
    server = socketserver.ThreadingTCPServer(("127.0.0.1", free_port()), FloodEngine)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    gport = free_port()
    proc = start_gateway(gport, gw_stack.db_url, f"http://127.0.0.1:{server.server_address[1]}",
                         tmp_path_factory.mktemp("floodgw") / "gateway.log", gw_stack.worker_class)
    try:
        wait_http(f"http://127.0.0.1:{gport}/health")
        yield f"http://127.0.0.1:{gport}", proc
    finally:
        stop([proc])
        server.shutdown()


def _gateway_pids(master: int) -> list[int]:
    with open(f"/proc/{master}/task/{master}/children") as f:
        return [master, *map(int, f.read().split())]


def test_a_client_reading_one_byte_a_second_does_not_grow_gateway_memory(gw, episode, flood_gateway):
    """The engine could send ~50 MB at once; the client reads one byte a second through a small
    receive buffer.  The gateway holds what the socket buffers hold and the engine waits (TCP
    back-pressure): the gateway's memory stays flat while the client dawdles; once the client
    leaves, the engine request is closed and the answer so far is recorded as partial."""
    ep, token = episode
    url, proc = flood_gateway
    path, body = request_for("chat", True, "flood me")
    body["max_tokens"] = 250_000
    data = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in auth_headers("chat", token).items())
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = url.split("//")[1].split(":")
    sock.connect((host, int(port)))
    sock.sendall((f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                  f"content-length: {len(data)}\r\n{head}\r\n").encode() + data)
    pids = _gateway_pids(proc.pid)
    FloodEngine.left.clear()
    try:
        assert sock.recv(12) == b"HTTP/1.1 200"
        time.sleep(1.0)
        before = _rss_kib(pids)
        for _ in range(4):  # one byte a second
            assert len(sock.recv(1)) == 1
            time.sleep(1.0)
        grown = _rss_kib(pids) - before
        assert grown < 16 * 1024, f"gateway memory grew {grown} KiB while the client read 4 bytes"
    finally:
        sock.close()
    # The engine, held by back-pressure, ends its answer only when the gateway closes its request
    # (FloodEngine.left): so seeing it at all is the close; the wait only bounds a hang.
    wait_for(lambda: FloodEngine.left and completions(ep), 60, interval=0.1,
             what="the engine request to be closed and the partial answer recorded")
    [rec] = completions(ep)
    assert rec.partial and "disconnected" in rec.error
    assert 0 < len(rec.sampled_ids) < 200_000
