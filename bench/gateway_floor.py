"""The gateway's server stack doing the least a gateway can: `bench/gateway.py`'s floor.

Served by gunicorn with the gateway's own config (`workers/gateway_conf.py`: the same worker
class, threads and heartbeat folder), this Flask app reads the request body and

* answers a non-stream call with a fixed chat.completion, calling no engine and recording nothing;
* relays a streamed call (`"stream": true`) byte for byte: it opens the engine's stream
  (`TURNSTILE_ENGINE_URLS`, the first) on a plain socket and writes every read to the client as
  it comes, with no parsing, no translation, no record and no pacing (a transparent proxy).

Their costs are the least that any gateway built on gunicorn + Flask adds to a call, and spends
per streamed token, on the machine the bench runs on.  The relayed body is the engine's own
(chunked) body inside the floor's chunked answer: well-formed for the bench's load client, which
counts text events in the bytes it receives, not for an SDK.
"""
from __future__ import annotations

import json
import os
import socket
from urllib.parse import urlsplit

from flask import Flask, Response, request

ANSWER = json.dumps({"id": "chatcmpl-floor", "object": "chat.completion", "model": "floor",
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": "The quick brown fox jumps over it."}}],
                     "usage": {"prompt_tokens": 1, "completion_tokens": 34, "total_tokens": 35}})


def _relay(body: dict):
    """The engine's streamed answer to `body` (a Chat request), each socket read as it comes."""
    engine = urlsplit(os.environ["TURNSTILE_ENGINE_URLS"].split(",")[0])
    data = json.dumps({**body, "return_token_ids": True, "logprobs": True,
                       "stream_options": {"include_usage": True}}).encode()
    sock = socket.create_connection((engine.hostname, engine.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (engine.netloc.encode(), len(data), data))

    def frames():
        try:
            while chunk := sock.recv(256 * 1024):
                yield chunk
        finally:
            sock.close()
    return frames()


def create_app() -> Flask:
    app = Flask(__name__)

    @app.route("/", defaults={"path": ""}, methods=["GET", "POST"])
    @app.route("/<path:path>", methods=["GET", "POST"])
    def answer(path: str) -> Response:
        raw = request.get_data()  # the body is read, as the gateway reads it
        body = json.loads(raw) if b'"stream"' in raw else None  # only a streamed call's body is parsed
        if isinstance(body, dict) and body.get("stream") is True:
            return Response(_relay(body), mimetype="text/event-stream", direct_passthrough=True)
        return Response(ANSWER, mimetype="application/json")

    return app
