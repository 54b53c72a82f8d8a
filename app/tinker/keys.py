"""Tinker API keys: the SDK's `api_key` is a Turnstile credential, one per named key in config.

The SDK sends its key in `X-API-Key` and refuses one that does not start with `tml-`
(tinker/lib/_auth_token_provider.py).  A key is

    tml-<name>-<derive(API token, "tinker-key:<name>")>

for each name of `TURNSTILE_TINKER_KEYS` (`app.auth.derive`: HMAC-SHA256 of the deployment's API
token), so nothing extra is stored: the service recomputes the secret and compares it in constant
time, and changing the API token revokes every Tinker key.  `turnstile token --tinker NAME` prints one.
"""
from __future__ import annotations

import re

from app.auth import api_token, derive, same
from app.config import Settings, get_settings

PREFIX = "tml-"
NAME = re.compile(r"^[a-z0-9][a-z0-9_.]{0,63}$")  # no '-': it ends the name inside the key


def key_for(name: str, settings: Settings | None = None) -> str:
    """The API key of key name `name`.  Raises ValueError when `name` is not in `TURNSTILE_TINKER_KEYS`."""
    settings = settings or get_settings()
    if name not in settings.tinker_keys:
        raise ValueError(f"{name!r} is not a Tinker key name; TURNSTILE_TINKER_KEYS has "
                         f"{', '.join(sorted(settings.tinker_keys)) or 'none'}")
    if not NAME.match(name):
        raise ValueError(f"Tinker key name {name!r}: use lowercase letters, digits, '_' and '.' (no '-')")
    return f"{PREFIX}{name}-{derive(api_token(settings), 'tinker-key:' + name)}"


def name_of(api_key: str | None, settings: Settings | None = None) -> str | None:
    """The key name whose key is `api_key`, or None (missing, malformed, unknown name, wrong secret)."""
    if not api_key or not api_key.startswith(PREFIX):
        return None
    name, sep, _secret = api_key[len(PREFIX):].partition("-")
    settings = settings or get_settings()
    if not sep or name not in settings.tinker_keys or not NAME.match(name):
        return None
    return name if same(api_key, key_for(name, settings)) else None
