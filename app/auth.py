"""The deployment's API token: who may drive the REST API, the dashboard and the engines' admin routes.

One secret per installation, a bearer token (RFC 6750: `Authorization: Bearer <token>`):

* `TURNSTILE_API_TOKEN` when set (environment or `.env`), else the contents of
  `<TURNSTILE_VAR_DIR>/api_token`, created on first use (32 random bytes, URL-safe base64, mode 0600,
  written with an exclusive link so that processes starting together all read the same token).
* The REST API (`/api/*` except `/api/health`), the dashboard pages and the embedded engine's
  `POST /v1/load_weights` require it; the gateway keeps its per-episode session keys.
* The dashboard signs in once (`/login`): the browser then holds an HttpOnly, SameSite=Strict
  cookie carrying `derive(token, "dashboard-session")`, never the token itself, and the pages'
  own POSTs send `derive(token, "csrf")` in `X-CSRF-Token` (the synchronizer-token rule of
  https://cheatsheetseries.owasp.org/cheatsheets/Cross-Site_Request_Forgery_Prevention_Cheat_Sheet.html).
  Changing the token signs every browser out.

Every comparison uses `hmac.compare_digest` (time independent of where the strings differ).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path

from app.config import Settings, get_settings

TOKEN_FILE_NAME = "api_token"
SESSION_COOKIE = "turnstile_session"
CSRF_HEADER = "X-CSRF-Token"


def token_path(settings: Settings | None = None) -> Path:
    """`<TURNSTILE_VAR_DIR>/api_token`: where the generated token lives."""
    return (settings or get_settings()).var_dir / TOKEN_FILE_NAME


def ensure_token_file(path: Path) -> str:
    """The token stored at `path`, generating it first (mode 0600) when the file does not exist.

    Creation is race-free: the new token is written to a private temporary file that is then
    hard-linked to `path`; a process that loses the race reads the winner's token.
    Raises OSError when the folder cannot be written or the file cannot be read, ValueError when
    the file exists but is empty.
    """
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    return _read(path)


def _read(path: Path) -> str:
    token = path.read_text(encoding="utf-8").strip()
    if not token:
        raise ValueError(f"{path} is empty: delete it to generate a new API token, or set TURNSTILE_API_TOKEN")
    return token


def api_token(settings: Settings | None = None) -> str:
    """The token in effect: `TURNSTILE_API_TOKEN`, else `<var_dir>/api_token` (created on first use)."""
    settings = settings or get_settings()
    if settings.api_token is not None:
        return settings.api_token.get_secret_value()
    return ensure_token_file(token_path(settings))


def auth_header(settings: Settings | None = None) -> dict[str, str]:
    """`{"Authorization": "Bearer <token>"}` for a client of the API or an engine's admin routes."""
    return {"Authorization": f"Bearer {api_token(settings)}"}


def bearer(header_value: str | None) -> str | None:
    """The credential of an `Authorization: Bearer <credential>` header (scheme case-insensitive), or None."""
    if not header_value:
        return None
    scheme, _, credential = header_value.strip().partition(" ")
    if scheme.lower() != "bearer" or not credential.strip():
        return None
    return credential.strip()


def same(given: str | None, expected: str) -> bool:
    """`given == expected` in time independent of their contents (`hmac.compare_digest`)."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8"))


def derive(token: str, purpose: str) -> str:
    """A value bound to `token` and `purpose` (HMAC-SHA256, URL-safe base64) that does not reveal it."""
    mac = hmac.new(token.encode("utf-8"), purpose.encode("utf-8"), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).decode("ascii").rstrip("=")


def main() -> int:
    """`python -m app.auth`: make sure the token exists and print where it comes from (not the token)."""
    settings = get_settings()
    if settings.api_token is not None:
        print("API token: TURNSTILE_API_TOKEN (environment or .env)")
    else:
        ensure_token_file(token_path(settings))
        print(f"API token: {token_path(settings)} (mode 0600; `python -m app token` prints it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
