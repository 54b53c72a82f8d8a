"""REST API blueprint registration."""
from __future__ import annotations

from flask import Flask


def register_api(flask_app: Flask) -> None:
    from app.api.errors import register_error_handlers
    from app.api.runs import bp as runs_bp

    flask_app.register_blueprint(runs_bp, url_prefix="/api")
    register_error_handlers(flask_app)
