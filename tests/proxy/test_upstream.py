"""The engine hop's HTTP parsing: an engine that answers with broken HTTP (a malformed chunk
size, a malformed Content-Length, a response head that never ends) costs the caller one
request, answered in its own API's error shape, and the gateway keeps serving.  The engine
here is a raw socket server, so the bytes on the wire are exactly the broken ones."""
from __future__ import annotations

import json
import socketserver
import threading

import pytest
from support.gateway_calls import APIS, parse, post, request_for
from support import read_http_request
from support.gateway import free_port, start_gateway, stop, wait_http

MODELS = b'{"object":"list","data":[{"id":"raw-engine","object":"model","max_model_len":4096}]}'
HEAD_OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
FIRST = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"raw-engine","prompt_token_ids":[5],'
         b'"choices":[{"index":0,"delta":{"role":"assistant","content":"hi"},"token_ids":[6],"finish_reason":null}]}'
         b"\n\n")
ANSWERS = {
    # a chunk size that is not hexadecimal, after one good chunk
    "bad_chunk": HEAD_OK + b"%x\r\n%s\r\n" % (len(FIRST), FIRST) + b"zz9\r\ndata: x\r\n",
    # a Content-Length that is not a number
    "bad_length": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12abc\r\n\r\n{}",
    # a response head that never ends (1 MiB of one header line, then the connection stays open)
    "endless_head": b"HTTP/1.1 200 OK\r\nx-filler: " + b"a" * (1024 * 1024),
}


class RawEngine(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        request = read_http_request(self.request)
        if request is None:
            return
        head, body = request
        if head.startswith(b"GET"):
            self.request.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                 b"connection: close\r\n\r\n%s" % (len(MODELS), MODELS))
            return
        mode = next((m for m in ANSWERS if m.encode() in body), "bad_chunk")
        try:
            self.request.sendall(ANSWERS[mode])
            if mode == "endless_head":
                self.request.recv(1)  # hold the connection open until the gateway gives up
        except OSError:
            pass


@pytest.fixture(scope="module")
def raw_gateway(gw_stack, tmp_path_factory):
    server = socketserver.ThreadingTCPServer(("127.0.0.1", free_port()), RawEngine)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    gport = free_port()
    proc = start_gateway(gport, gw_stack.db_url, f"http://127.0.0.1:{server.server_address[1]}",
                         tmp_path_factory.mktemp("rawgw") / "gateway.log")
    try:
        wait_http(f"http://127.0.0.1:{gport}/health")
        yield type("GW", (), {"gateway_url": f"http://127.0.0.1:{gport}"})()
    finally:
        stop([proc])
        server.shutdown()


def _check_error(api: str, stream: bool, resp) -> None:
    if not stream or resp.status_code != 200:
        assert resp.status_code == 502, resp.text
        body = resp.json()
        if api == "anthropic":
            assert body["type"] == "error" and body["error"]["type"] == "api_error"
        elif api == "gemini":
            assert body["error"]["status"] == "INTERNAL" and body["error"]["code"] == 502
        else:
            assert body["error"]["type"] == "server_error" and body["error"]["message"]
        return
    # The head was already sent: the stream ends with the API's own error (grammar-checked).
    a = parse(api, True, resp)
    assert a.stop == {"anthropic": "error", "chat": "error", "responses": "failed:upstream_error",
                      "gemini": "error"}[api]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", sorted(ANSWERS))
def test_broken_http_from_the_engine_is_the_apis_own_error(gw, raw_gateway, episode, api, stream, mode):
    _, token = episode
    path, body = request_for(api, stream, f"answer {mode}")
    resp = post(raw_gateway, token, api, path, json.dumps(body))
    _check_error(api, stream, resp)
    assert "Traceback" not in resp.text
    # the gateway still answers (the worker survived)
    assert post(raw_gateway, token, api, path, json.dumps(body)).status_code in (200, 502)
