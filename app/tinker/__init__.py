"""A Tinker-compatible training service: the unmodified `tinker` SDK trains LoRA tenants here.

`create_tinker_app()` is its own gunicorn app (Procfile `tinker`, `TURNSTILE_TINKER_BIND`, :8300 by
default; the SDK's `base_url`), not a blueprint of the REST API: the SDK's types, which the
service decodes and encodes the wire format with, import torch (about 1 s and a few hundred MB
per worker, measured here), and the REST API process stays torch-free (`.importlinter`'s
light-api contract).  Routes, wire formats and what maps to what: docs/tinker.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flask import Flask


def create_tinker_app(overrides: dict[str, Any] | None = None) -> Flask:
    """The Tinker service's Flask app: every `/api/v1/...` route the SDK calls."""
    from flask import Flask

    from app.tinker.http import TinkerError, error_response
    from app.tinker.routes_ops import bp as ops
    from app.tinker.routes_setup import bp as setup

    flask_app = Flask(__name__)
    flask_app.json.sort_keys = False
    if overrides:
        flask_app.config.update(overrides)
    flask_app.register_blueprint(ops)
    flask_app.register_blueprint(setup)  # last: its catch-all must not shadow an op route
    flask_app.register_error_handler(TinkerError, error_response)

    @flask_app.errorhandler(404)
    def _not_found(_exc):  # a path outside /api/v1 (the catch-all covers the rest)
        return error_response(TinkerError(404, "not a Tinker route: the SDK's base_url is this server's root"))

    @flask_app.errorhandler(405)
    def _bad_method(_exc):
        return error_response(TinkerError(405, "method not allowed on this Tinker route"))

    return flask_app
