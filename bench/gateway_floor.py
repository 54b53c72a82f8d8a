"""The gateway's server stack answering a constant: `bench/gateway.py`'s floor.

Served by gunicorn with the gateway's own config (`workers/gateway_conf.py`: gthread workers,
the same threads and heartbeat folder), this Flask app reads the request body and answers a
fixed chat.completion without calling an engine or recording anything.  Its latency is the
least that any gateway built on gunicorn + Flask adds to a call on the machine the bench runs on.
"""
from __future__ import annotations

import json

from flask import Flask, Response, request

ANSWER = json.dumps({"id": "chatcmpl-floor", "object": "chat.completion", "model": "floor",
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": "The quick brown fox jumps over it."}}],
                     "usage": {"prompt_tokens": 1, "completion_tokens": 34, "total_tokens": 35}})


def create_app() -> Flask:
    app = Flask(__name__)

    @app.route("/", defaults={"path": ""}, methods=["GET", "POST"])
    @app.route("/<path:path>", methods=["GET", "POST"])
    def answer(path: str) -> Response:
        request.get_data()  # the body is read, as the gateway reads it
        return Response(ANSWER, mimetype="application/json")

    return app
