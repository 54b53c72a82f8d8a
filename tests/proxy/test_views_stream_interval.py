"""The stream interval (`TURNSTILE_GATEWAY_STREAM_INTERVAL_MS`): tokens that come faster than it
go out together, each event still whole and in order; a stream slower than it is written token by
token, as with no interval at all.

Each gunicorn write of a streamed body is one HTTP/1.1 chunk (RFC 9112 §7.1), so the number of
chunks a raw client reads is the number of writes the gateway made."""
from __future__ import annotations

import json
import socket

import pytest
from support.gateway import completions, free_port, start_gateway, stop, wait_http
from support.gateway_calls import auth_headers, request_for

from app.conformance.scripted import directive, encode

FAST = "".join(chr(0x61 + i % 26) for i in range(120))  # 120 one-character tokens
SLOW = "abcdef"


@pytest.fixture(scope="module")
def gateways(gw_stack, tmp_path_factory):
    """Two gateways beside the stack's, on its engine and database: interval 0 and 40 ms."""
    tmp = tmp_path_factory.mktemp("interval")
    ports = {ms: free_port() for ms in (0, 40)}
    procs = {ms: start_gateway(port, gw_stack.db_url, gw_stack.engine_url, tmp / f"gateway-{ms}.log",
                               TURNSTILE_GATEWAY_STREAM_INTERVAL_MS=str(ms)) for ms, port in ports.items()}
    try:
        for port in ports.values():
            wait_http(f"http://127.0.0.1:{port}/health")
        yield {ms: port for ms, port in ports.items()}
    finally:
        stop(list(procs.values()))


def _stream(port: int, token: str, text: str, token_delay: float) -> list[list[str]]:
    """The text deltas of a Chat Completions stream, per HTTP chunk of the body (per write)."""
    path, body = request_for("chat", True, directive({"text": text, "token_delay": token_delay}))
    body["max_tokens"] = 1000
    data = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in auth_headers("chat", token).items())
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall((f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n"
                      f"content-type: application/json\r\ncontent-length: {len(data)}\r\n{head}\r\n").encode() + data)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    status, _, rest = raw.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200") and b"chunked" in status.lower(), status
    writes = []
    while True:  # the chunked framing: size in hex, CRLF, data, CRLF; a 0-size chunk ends it
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        writes.append(rest[:n])
        assert rest[n:n + 2] == b"\r\n"
        rest = rest[n + 2:]
    assert all(w.endswith(b"\n\n") for w in writes), "an event was split across writes"
    return [[choice["delta"]["content"] for event in w.split(b"\n\n")
             if event.startswith(b"data: {") for choice in json.loads(event[6:])["choices"]
             if choice["delta"].get("content")] for w in writes]


def test_tokens_faster_than_the_interval_go_out_together_whole_and_in_order(gw, episode, gateways):
    """120 tokens 2 ms apart (0.24 s): with no interval nearly every token is a write of its own;
    with 40 ms the same answer takes a handful of writes, and the client still gets every event."""
    ep, token = episode
    every = _stream(gateways[0], token, FAST, 0.002)
    paced = _stream(gateways[40], token, FAST, 0.002)
    assert sum(every, []) == sum(paced, []) == list(FAST)  # one event per token, in order, none merged
    assert len(every) > 60, f"{len(every)} writes with no interval"
    assert len(paced) <= 20, f"{len(paced)} writes at 40 ms for a 0.24 s answer"
    recs = completions(ep)
    assert [r.sampled_ids for r in recs] == [encode(FAST)] * 2 and not any(r.partial for r in recs)


def test_a_stream_slower_than_the_interval_is_written_token_by_token(gw, episode, gateways):
    """Tokens 80 ms apart against a 40 ms interval: each token is a write of its own, as with no
    interval (no token waits for the next)."""
    ep, token = episode
    for port in (gateways[0], gateways[40]):
        writes = _stream(port, token, SLOW, 0.08)
        assert [w for w in writes if w] == [[c] for c in SLOW]
