"""The gateway's settings: its TURNSTILE_GATEWAY_* knobs read from `app.config` (`gateway_settings()`).

Below every other gateway module (normalization, size caps, relay, sessions), which all read it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.config import Settings, get_settings


def _default(name: str) -> Any:
    return Settings.model_fields[f"gateway_{name}"].default


@dataclass(frozen=True)
class GatewaySettings:
    """The gateway's knobs: the TURNSTILE_GATEWAY_* settings of `app.config` (defaults there)."""

    default_max_tokens: int = _default("default_max_tokens")  # when the client sends no limit (Codex)
    max_body_bytes: int = _default("max_body_bytes")
    max_decoded_bytes: int = _default("max_decoded_bytes")  # one value decoded from a request (app.proxy.limits)
    max_prompt_bytes: int | None = _default("max_prompt_bytes")  # the engine request; None: max_body_bytes
    keepalive_s: float = _default("keepalive_s")              # keep-alive interval while the engine prefills
    stream_interval_ms: float = _default("stream_interval_ms")  # least time between a stream's writes (relay)
    vision: bool = _default("vision")                          # engine model accepts images; else placeholders
    session_cache_s: float = _default("session_cache_s")      # how long a resolved session token is trusted
    upstream_timeout_s: float = _default("upstream_timeout_s")

    @classmethod
    def from_settings(cls, s: Settings) -> "GatewaySettings":
        return cls(default_max_tokens=s.gateway_default_max_tokens, max_body_bytes=s.gateway_max_body_bytes,
                   max_decoded_bytes=s.gateway_max_decoded_bytes, max_prompt_bytes=s.gateway_max_prompt_bytes,
                   keepalive_s=s.gateway_keepalive_s, stream_interval_ms=s.gateway_stream_interval_ms,
                   vision=s.gateway_vision,
                   session_cache_s=s.gateway_session_cache_s, upstream_timeout_s=s.gateway_upstream_timeout_s)


_settings: GatewaySettings | None = None  # an override (tests); None: follow app.config
_cached: tuple[Settings, GatewaySettings] | None = None


def gateway_settings() -> GatewaySettings:
    """The gateway's settings, from `app.config.get_settings()` (so `reset_settings()` applies here too)."""
    if _settings is not None:
        return _settings
    global _cached
    s = get_settings()
    if _cached is None or _cached[0] is not s:
        _cached = (s, GatewaySettings.from_settings(s))
    return _cached[1]
