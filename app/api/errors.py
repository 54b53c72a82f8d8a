"""JSON errors for the REST API: `{"error": {"message", "field"?, "details"?}}`."""
from __future__ import annotations

from flask import Flask, jsonify, render_template, request
from werkzeug.exceptions import HTTPException


class ApiError(Exception):
    """An error answered to the client with `status` and a message (and the field at fault)."""

    def __init__(self, status: int, message: str, field: str | None = None, details: list | None = None):
        super().__init__(message)
        self.status, self.message, self.field, self.details = status, message, field, details


FLAG_TRUE, FLAG_FALSE = {"1", "true", "yes"}, {"", "0", "false", "no"}


def parse_flag(name: str, raw: str | None) -> bool:
    """A yes/no query parameter `name`: 1/true/yes, or 0/false/no/absent (any case).

    Raises ValueError naming `name` for anything else: a mistyped flag must not act as its
    default (`?dry_run=yes please` creating the run it meant to check)."""
    value = (raw or "").strip().lower()
    if value not in FLAG_TRUE | FLAG_FALSE:
        raise ValueError(f"{name}: {(raw or '')[:40]!r} is not one of 1, 0, true, false")
    return value in FLAG_TRUE


def query_flag(name: str) -> bool:
    """`parse_flag` of the request's query parameter `name`; ApiError 400 naming it otherwise."""
    try:
        return parse_flag(name, request.args.get(name))
    except ValueError as exc:
        raise ApiError(400, str(exc), name) from None


def error_body(message: str, field: str | None = None, details: list | None = None) -> dict:
    err: dict = {"message": message}
    if field is not None:
        err["field"] = field
    if details:
        err["details"] = details
    return {"error": err}


def register_error_handlers(flask_app: Flask) -> None:
    @flask_app.errorhandler(ApiError)
    def _api_error(exc: ApiError):
        return jsonify(error_body(exc.message, exc.field, exc.details)), exc.status

    @flask_app.errorhandler(RecursionError)
    def _too_deep(exc: RecursionError):
        # JSON nested thousands deep exhausts the parser's recursion: a bad request, not a crash.
        return jsonify(error_body("request body is nested too deeply")), 400

    @flask_app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        # REST clients get the JSON error shape; people on dashboard pages get a page.
        if request.path.startswith("/api/") or request.path == "/api":
            return jsonify(error_body(exc.description or exc.name)), exc.code
        return render_template("dashboard/error.html", code=exc.code, message=exc.description or exc.name), exc.code
