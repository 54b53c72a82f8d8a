"""REST API and dashboard blueprint registration."""
from __future__ import annotations

from flask import Flask


def register_api(flask_app: Flask) -> None:
    """The REST API under /api and the dashboard pages at / (one process, one app)."""
    from app.api.dashboard import bp as dashboard_bp
    from app.api.errors import register_error_handlers
    from app.api.runs import bp as runs_bp

    flask_app.register_blueprint(runs_bp, url_prefix="/api")
    flask_app.register_blueprint(dashboard_bp)
    register_error_handlers(flask_app)
