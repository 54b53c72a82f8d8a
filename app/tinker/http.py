"""What every Tinker route shares: the caller's key, the SDK version check, bodies and errors.

Errors are `TinkerError(status, message)`, answered as `{"detail": message}` with
`x-should-retry: false` for a 4xx (the SDK's HTTP client obeys that header, tinker/_base_client.py),
so the SDK raises at once the exception of that status (tinker/_exceptions.py: 400
BadRequestError, 401 AuthenticationError, 403 PermissionDeniedError, 404 NotFoundError, 429
RateLimitError, which it backs off and retries), its message holding `detail`.

The SDK names its version in `X-Stainless-Package-Version` on every request (tinker/_base_client.py
`platform_headers`) and in the bodies of `client/config` and `create_session`; a version not in
`TURNSTILE_TINKER_SDK_VERSIONS` is a 400 that names the tested ones.  A request without the header
(curl) is not the SDK and is not refused for it.
"""
from __future__ import annotations

import functools
import json
from typing import Any, Callable

from flask import Response, g, request
from pydantic import BaseModel, ValidationError

from app.config import get_settings
from app.tinker.keys import name_of

VERSION_HEADER = "X-Stainless-Package-Version"
KEY_HEADER = "X-API-Key"


class TinkerError(Exception):
    """An answer other than success: HTTP `status` with `message` for the SDK to show."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def error_response(exc: TinkerError) -> Response:
    resp = Response(json.dumps({"detail": exc.message}), status=exc.status, mimetype="application/json")
    if 400 <= exc.status < 500 and exc.status not in (408, 429):
        resp.headers["x-should-retry"] = "false"
    return resp


def check_version(version: str | None) -> None:
    """Raise a 400 `TinkerError` when `version` (the SDK's) is given and not a tested one."""
    tested = get_settings().tinker_sdk_versions
    if version is not None and version not in tested:
        raise TinkerError(400, f"tinker SDK {version} is not supported by this Turnstile server, which is tested "
                               f"with tinker {', '.join(tested)}: install one of those (pip install "
                               f"tinker=={tested[-1]}), or add {version} to TURNSTILE_TINKER_SDK_VERSIONS once "
                               "tests/tinker pass with it")


def authed(view: Callable[..., Any]) -> Callable[..., Any]:
    """Route decorator: the SDK version is a tested one and `X-API-Key` is a Tinker key; the key's
    name is `g.key_name` inside the view.  401 for a missing or wrong key."""

    @functools.wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        check_version(request.headers.get(VERSION_HEADER))
        name = name_of(request.headers.get(KEY_HEADER))
        if name is None:
            raise TinkerError(401, "invalid or missing Tinker API key (X-API-Key): use a key that "
                                   "`turnstile token --tinker NAME` prints for a name in TURNSTILE_TINKER_KEYS")
        g.key_name = name
        return view(*args, **kwargs)

    return wrapper


def max_body_bytes() -> int:
    quota = get_settings().tinker_keys.get(getattr(g, "key_name", ""), None)
    return int((quota.max_request_mb if quota else 64.0) * 1024 * 1024)


def json_body(model: type[BaseModel] | None = None) -> Any:
    """The request's JSON body, validated as the SDK's pydantic request `model` when given.
    400 for a body that is not JSON, not an object, or not that type (the first problem named)."""
    raw = request.get_data(cache=True)
    if len(raw) > max_body_bytes():
        raise TinkerError(413, f"the body is over this key's limit of {max_body_bytes()} bytes")
    try:
        body = json.loads(raw or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TinkerError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise TinkerError(400, f"the body must be a JSON object, not {type(body).__name__}")
    if model is None:
        return body
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        raise TinkerError(400, f"not a {model.__name__}: {where}: {err.get('msg')} "
                               f"({len(exc.errors())} problem(s))") from None


def idempotency_key() -> str | None:
    """The SDK's `X-Idempotency-Key` (the same on each retry of one request), or None."""
    key = request.headers.get("X-Idempotency-Key")
    return key[:128] if key else None
