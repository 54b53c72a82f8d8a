"""Authentication of the API process: every route but `/api/health`, `/login` and static files.

Accepted credentials (`app.auth` states the token rules):

* `Authorization: Bearer <token>`: the CLI, scripts, curl.  A wrong token is a 401 even when a
  dashboard cookie is present too.
* The dashboard's session cookie (set by `/login`): GET/HEAD of pages and of the REST API; other
  methods also need the page's CSRF value in `X-CSRF-Token`.

A request without a valid credential gets 401 in the API's JSON error shape under `/api/`
(with `WWW-Authenticate: Bearer`, RFC 6750 §3), and a redirect to `/login` on dashboard pages.
"""
from __future__ import annotations

from urllib.parse import urlsplit

from flask import Blueprint, Flask, current_app, g, jsonify, redirect, render_template, request, url_for

from app import auth
from app.api.errors import error_body

bp = Blueprint("auth", __name__)  # its page, dashboard/login.html, is found through the dashboard blueprint

PUBLIC_ENDPOINTS = {"api.health", "auth.login", "auth.login_submit", "auth.logout", "dashboard.static"}
SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
COOKIE_MAX_AGE_S = 30 * 24 * 3600


def _token() -> str:
    return current_app.config["API_TOKEN"]


def _unauthorized(message: str):
    if request.path.startswith("/api/") or request.path == "/api" or request.method not in SAFE_METHODS:
        resp = jsonify(error_body(message))
        resp.status_code = 401
        resp.headers["WWW-Authenticate"] = 'Bearer realm="turnstile"'
        return resp
    return redirect(url_for("auth.login", next=request.full_path.rstrip("?")), code=303)


def _check():
    """`before_request`: None when the request may proceed, else the 401 / redirect answer."""
    if request.endpoint in PUBLIC_ENDPOINTS:
        return None
    token = _token()
    header = request.headers.get("Authorization")
    if header is not None:
        if auth.same(auth.bearer(header), token):
            g.authenticated = True
            return None
        return _unauthorized("invalid API token (Authorization: Bearer <token>; `python -m app token` prints it)")
    cookie = request.cookies.get(auth.SESSION_COOKIE)
    if cookie is not None and auth.same(cookie, auth.derive(token, "dashboard-session")):
        if request.method in SAFE_METHODS or auth.same(request.headers.get(auth.CSRF_HEADER),
                                                        auth.derive(token, "csrf")):
            g.authenticated = True
            return None
        return _unauthorized(f"a dashboard request that changes something needs the page's {auth.CSRF_HEADER} header")
    return _unauthorized("authentication required: send Authorization: Bearer <token> "
                         "(`python -m app token` prints it), or sign in to the dashboard at /login")


def _safe_next(target: str | None) -> str:
    """Only a path on this site (no scheme, no host, no `//`): an open redirect is refused."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    parts = urlsplit(target)
    return "/" if parts.scheme or parts.netloc else target


@bp.get("/login")
def login():
    return render_template("dashboard/login.html", next=_safe_next(request.args.get("next")), error=None)


@bp.post("/login")
def login_submit():
    given = request.form.get("token", "").strip()
    target = _safe_next(request.form.get("next"))
    if not auth.same(given, _token()):
        return render_template("dashboard/login.html", next=target, error="That is not this installation's API token."), 401
    resp = redirect(target, code=303)
    resp.set_cookie(auth.SESSION_COOKIE, auth.derive(_token(), "dashboard-session"), max_age=COOKIE_MAX_AGE_S,
                    httponly=True, samesite="Strict", secure=request.is_secure, path="/")
    return resp


@bp.post("/logout")
def logout():
    resp = redirect(url_for("auth.login"), code=303)
    resp.delete_cookie(auth.SESSION_COOKIE, path="/")
    return resp


def init_auth(flask_app: Flask) -> None:
    """Require the token on `flask_app` (the token is read once, here: restart the API after changing it)."""
    if not flask_app.config.get("API_TOKEN"):
        flask_app.config["API_TOKEN"] = auth.api_token()
    flask_app.register_blueprint(bp)
    flask_app.before_request(_check)

    @flask_app.context_processor
    def _csrf():
        # Signed-in pages put this in <meta name="csrf-token">; dashboard.js sends it on POSTs.
        signed_in = g.get("authenticated", False)
        return {"csrf_token": auth.derive(flask_app.config["API_TOKEN"], "csrf") if signed_in else ""}
