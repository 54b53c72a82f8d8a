"""Turnstile: GRPO training of unmodified coding agents.

`create_app()` builds the REST API's Flask app.  There is deliberately no
module-level object named `app` or `celery` here: `celery -A app` looks for
those names first and must find the Celery instance in `app/celery.py`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported lazily so `app.*` modules load where Flask is absent (GPU check boxes)
    from flask import Flask


def create_app(overrides: dict[str, Any] | None = None) -> Flask:
    """Build the API + dashboard Flask app (served by gunicorn on :8000)."""
    from flask import Flask

    from app.api import register_api

    flask_app = Flask(__name__)
    flask_app.config.update(MAX_CONTENT_LENGTH=4 * 1024 * 1024)
    flask_app.json.sort_keys = False  # keep the response models' field order (Flask 3 reads this, not JSON_SORT_KEYS)
    if overrides:
        flask_app.config.update(overrides)
    register_api(flask_app)
    return flask_app
