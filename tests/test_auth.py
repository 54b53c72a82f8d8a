"""The API token: required on every REST route but health and on the dashboard; generated once, 0600."""
from __future__ import annotations

import stat
import threading

import pytest

from app import auth, create_app
from app.config import Settings
from support import API_TOKEN, AUTH

REDIS_DB = 10

ROUTES = [("GET", "/api/runs"), ("POST", "/api/runs"), ("GET", "/api/runs/1"), ("POST", "/api/runs/1/cancel"),
          ("GET", "/api/runs/1/episodes"), ("GET", "/api/episodes/1"), ("GET", "/api/runs/1/export"),
          ("GET", "/api/openapi.json"), ("GET", "/api/nowhere")]


@pytest.fixture
def app(database, redis_db):
    return create_app({"TESTING": True})


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-token"}, {"Authorization": API_TOKEN},
                                     {"Authorization": f"Basic {API_TOKEN}"}, {"Authorization": "Bearer "}],
                         ids=["none", "wrong", "no-scheme", "basic", "empty"])
def test_every_api_route_needs_the_token(app, headers):
    client = app.test_client()
    for method, path in ROUTES:
        resp = client.open(path, method=method, headers=headers, json={} if method == "POST" else None)
        assert resp.status_code == 401, (method, path, resp.status_code)
        assert resp.is_json and set(resp.get_json()) == {"error"} and resp.get_json()["error"]["message"]
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert client.get("/api/health").status_code == 200  # liveness stays open (no data)


def test_the_right_token_passes_and_a_wrong_one_beats_a_cookie(app):
    client = app.test_client()
    assert client.get("/api/runs", headers=AUTH).status_code == 200
    assert client.get("/api/runs", headers={"Authorization": f"bearer {API_TOKEN}"}).status_code == 200
    assert client.get("/api/runs/1", headers=AUTH).status_code == 404
    client.post("/login", data={"token": API_TOKEN})
    assert client.get("/api/runs").status_code == 200  # signed-in browser
    assert client.get("/api/runs", headers={"Authorization": "Bearer wrong-token"}).status_code == 401


def test_dashboard_signs_in_once_and_posts_need_the_csrf_value(app):
    client = app.test_client()
    page = client.get("/runs/1")
    assert page.status_code == 303 and page.headers["Location"] == "/login?next=/runs/1"
    wrong = client.post("/login", data={"token": "not-the-token", "next": "/compare"})
    assert wrong.status_code == 401 and b"not this installation" in wrong.data
    assert auth.SESSION_COOKIE not in (wrong.headers.get("Set-Cookie") or "")
    ok = client.post("/login", data={"token": API_TOKEN, "next": "/compare"})
    assert ok.status_code == 303 and ok.headers["Location"] == "/compare"
    cookie = ok.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and API_TOKEN not in cookie
    compare = client.get("/compare")
    assert compare.status_code == 200
    csrf = auth.derive(API_TOKEN, "csrf")
    assert f'<meta name="csrf-token" content="{csrf}">' in compare.get_data(as_text=True)
    assert client.post("/api/runs/1/cancel").status_code == 401  # cookie alone: no
    assert client.post("/api/runs/1/cancel", headers={auth.CSRF_HEADER: csrf}).status_code == 404  # allowed, no run
    client.post("/logout")
    assert client.get("/compare").status_code == 303


@pytest.mark.parametrize("target", ["//evil.example/x", "https://evil.example/", "/\\evil.example", "javascript:x"])
def test_login_never_redirects_off_site(app, target):
    resp = app.test_client().post("/login", data={"token": API_TOKEN, "next": target})
    assert resp.status_code == 303 and resp.headers["Location"] == "/"


def test_token_file_is_generated_once_with_mode_0600_even_under_a_race(tmp_path):
    settings = Settings(var_dir=tmp_path / "var", api_token=None)
    tokens: list[str] = []
    threads = [threading.Thread(target=lambda: tokens.append(auth.api_token(settings))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    path = auth.token_path(settings)
    assert len(set(tokens)) == 1 and len(tokens[0]) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert auth.api_token(settings) == tokens[0] == path.read_text().strip()
    assert sorted(p.name for p in path.parent.iterdir()) == ["api_token"]  # no temporary files left
    assert auth.api_token(Settings(var_dir=tmp_path / "var", api_token="x" * 16)) == "x" * 16  # the setting wins


def test_cli_sends_the_token(monkeypatch, app, capsys):
    import httpx

    from app.cli import main

    transport = httpx.WSGITransport(app=app)
    real_client = httpx.Client

    monkeypatch.setattr(httpx, "Client", lambda **kw: real_client(transport=transport, **{**kw, "base_url": "http://api"}))
    assert main(["runs"]) == 0
    monkeypatch.setenv("TURNSTILE_API_TOKEN", "wrong-token-0123456789")
    from app import config

    config.reset_settings()
    assert main(["runs"]) == 1
    err = capsys.readouterr().err
    assert "401" in err and "TURNSTILE_API_TOKEN" in err
    assert main(["token"]) == 0 and capsys.readouterr().out.strip() == "wrong-token-0123456789"
