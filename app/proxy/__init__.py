"""The gateway: the model-API boundary every harness call passes through.

`create_gateway_app()` builds its Flask app, served by
`gunicorn -c workers/gateway_conf.py 'app.proxy:create_gateway_app()'` on :8100.
It answers Anthropic Messages, OpenAI Chat Completions, OpenAI Responses and
Gemini generateContent in their own wire formats, forwards one internal Chat
Completions request to an engine, and records token ids and logprobs.  It must
not import torch/transformers/training code (it runs on small CPU boxes).
"""
from __future__ import annotations

import logging
from typing import Any

from flask import Flask


def create_gateway_app(overrides: dict[str, Any] | None = None) -> Flask:
    """Build the gateway's Flask app (routes in `app.proxy.views`)."""
    from app.proxy import views
    from app.proxy.common import gateway_settings

    app = Flask("turnstile.gateway", static_folder=None)
    app.config.update(MAX_CONTENT_LENGTH=gateway_settings().max_body_bytes)
    if overrides:
        app.config.update(overrides)
    views.register(app)
    logging.getLogger("turnstile.gateway").setLevel(logging.INFO)
    return app
