"""Settings, read once from the environment, typed, with defaults.

Every process (api, gateway, engine, workers) reads the same variables, so one
`.env`/shell export configures a whole deployment.  Parsing is strict: a bad
boolean or integer raises `ValueError` naming the variable instead of silently
becoming a default (redash's settings helpers do the same).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    low = raw.strip().lower()
    if low in {"1", "true", "yes", "on"}:
        return True
    if low in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean (use true/false, 1/0, yes/no, on/off)")


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def _list(name: str, default: str) -> list[str]:
    raw = os.environ.get(name) or default
    return [item.strip() for item in raw.split(",") if item.strip()]


def _str(name: str, default: str) -> str:
    return os.environ.get(name) or default


@dataclass(frozen=True)
class Settings:
    """All Turnstile settings. Build with `Settings.from_env()`; tests pass overrides."""

    var_dir: Path
    database_url: str
    redis_url: str
    broker_url: str
    result_backend: str
    api_url: str
    gateway_url: str
    engine_urls: list[str]
    # Longest a single Celery task may run (seconds).  An episode is bounded by
    # its own agent budget; this is the hard ceiling above every stage.
    task_soft_time_limit: int
    task_time_limit: int
    visibility_timeout: int
    max_redeliveries: int
    log_level: str
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> "Settings":
        var_dir = Path(_str("TURNSTILE_VAR_DIR", str(ROOT / "var"))).resolve()
        redis_url = _str("REDIS_URL", "redis://localhost:6379/0")
        soft = _int("TURNSTILE_TASK_SOFT_TIME_LIMIT", 3600)
        hard = _int("TURNSTILE_TASK_TIME_LIMIT", soft + 120)
        if hard <= soft:
            raise ValueError("TURNSTILE_TASK_TIME_LIMIT must be above TURNSTILE_TASK_SOFT_TIME_LIMIT")
        return cls(
            var_dir=var_dir,
            database_url=_str("DATABASE_URL", f"sqlite:///{var_dir / 'turnstile.db'}"),
            redis_url=redis_url,
            broker_url=_str("CELERY_BROKER_URL", redis_url),
            result_backend=_str("CELERY_RESULT_BACKEND", redis_url),
            api_url=_str("TURNSTILE_API_URL", "http://127.0.0.1:8000"),
            gateway_url=_str("TURNSTILE_GATEWAY_URL", "http://127.0.0.1:8100"),
            engine_urls=_list("TURNSTILE_ENGINE_URLS", "http://127.0.0.1:8200"),
            task_soft_time_limit=soft,
            task_time_limit=hard,
            # Redis redelivers an unacked task after this many seconds; it must be
            # above the longest task or a running episode would be started twice.
            visibility_timeout=_int("TURNSTILE_VISIBILITY_TIMEOUT", max(4 * 3600, hard * 2)),
            max_redeliveries=_int("TURNSTILE_MAX_REDELIVERIES", 3),
            log_level=_str("TURNSTILE_LOG_LEVEL", "INFO"),
        )


_settings: Settings | None = None


def get_settings() -> Settings:
    """Process-wide settings (read from the environment on first use)."""
    global _settings
    if _settings is None:
        _settings = Settings.from_env()
    return _settings


def reset_settings() -> None:
    """Forget cached settings (tests change the environment between cases)."""
    global _settings
    _settings = None
