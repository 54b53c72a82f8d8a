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
    from app.proxy.settings import gateway_settings

    _sqlite_fast_commits()
    app = Flask("turnstile.gateway", static_folder=None)
    app.config.update(MAX_CONTENT_LENGTH=gateway_settings().max_body_bytes)
    if overrides:
        app.config.update(overrides)
    views.register(app)
    logging.getLogger("turnstile.gateway").setLevel(logging.INFO)
    return app


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    if type(dbapi_conn).__module__.startswith("sqlite3"):
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()


def _sqlite_fast_commits() -> None:
    """Gateway connections to SQLite use `synchronous=NORMAL` (with WAL): a commit no longer waits
    for an fsync, which cut the record write from ~9 ms to under 1 ms on the dev box.  Still
    durable across gateway crashes (the WAL lives in the OS page cache); only an OS crash or power
    loss can drop the last commits (https://www.sqlite.org/pragma.html#pragma_synchronous).
    PostgreSQL connections are untouched."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    if not event.contains(Engine, "connect", _sqlite_pragmas):
        event.listen(Engine, "connect", _sqlite_pragmas)
