"""REST API and dashboard blueprint registration."""
from __future__ import annotations

from flask import Flask
from werkzeug.routing import IntegerConverter


class RowIdConverter(IntegerConverter):
    """A row id in a URL: 1 .. 2**31 - 1 (SQL INTEGER on PostgreSQL); anything else is no such route (404),
    never an out-of-range error from the database."""

    def __init__(self, url_map, **kwargs) -> None:
        super().__init__(url_map, min=1, max=2**31 - 1)


def register_api(flask_app: Flask) -> None:
    """The REST API under /api and the dashboard pages at / (one process, one app)."""
    from app.api.auth import init_auth
    from app.api.comparisons import bp as comparisons_bp
    from app.api.dashboard import bp as dashboard_bp
    from app.api.errors import register_error_handlers
    from app.api.labels import bp as labels_bp
    from app.api.metrics import bp as metrics_bp
    from app.api.runs import bp as runs_bp

    flask_app.url_map.converters["id"] = RowIdConverter
    flask_app.register_blueprint(runs_bp, url_prefix="/api")
    flask_app.register_blueprint(labels_bp, url_prefix="/api")
    flask_app.register_blueprint(metrics_bp, url_prefix="/api")
    flask_app.register_blueprint(comparisons_bp, url_prefix="/api")
    flask_app.register_blueprint(dashboard_bp)
    register_error_handlers(flask_app)
    init_auth(flask_app)  # every route but /api/health, /login and static files needs the API token
