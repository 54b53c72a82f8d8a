"""Fixtures of the CLI's tests."""
from __future__ import annotations

import httpx
import pytest

from app import create_app
from app.cli import client as cli_client
from support import AUTH


@pytest.fixture
def api(database, redis_db, monkeypatch):
    """The CLI's HTTP client talks to `create_app()` in-process (over WSGI: the real Flask app,
    real SQL and Redis, no sockets)."""
    flask_app = create_app({"TESTING": True})
    monkeypatch.setattr(cli_client, "api_client", lambda: httpx.Client(transport=httpx.WSGITransport(app=flask_app),
                                                                      base_url="http://api", headers=AUTH))
    return flask_app
