"""A real Tinker service for the SDK's tests: `app.tinker:create_tinker_app()` under gunicorn
(workers/tinker_conf.py), real SQLite and Redis, two API keys (alice, bob).  No gpu worker here:
the ops' Celery messages wait on the gpu queue, and the tests that need a result finish the
future through `app.control.tinker_futures` as the worker would."""
from __future__ import annotations

import json
import os
import sys

import httpx
import pytest
import redis

from app import config
from support import REDIS_BASE, free_port, wait_for

REDIS_DB = 12
KEYS = {"alice": {"max_models": 3}, "bob": {}}


@pytest.fixture
def tinker_redis(request):
    """The broker of the ops' messages, flushed before and after: Redis DB `REDIS_DB`, or the test
    module's own `TINKER_REDIS_DB` (so two test files running side by side, each with workers,
    never take each other's messages)."""
    client = redis.Redis.from_url(f"{REDIS_BASE}/{getattr(request.module, 'TINKER_REDIS_DB', REDIS_DB)}")
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def tinker_env(database, tinker_redis, monkeypatch):
    """The settings of the service and of this process: the two keys, this area's Redis DB."""
    monkeypatch.setenv("TURNSTILE_TINKER_KEYS", json.dumps(KEYS))
    monkeypatch.setenv("REDIS_URL", f"{REDIS_BASE}/{tinker_redis.connection_pool.connection_kwargs['db']}")
    monkeypatch.setenv("TURNSTILE_TINKER_WORKERS", "1")
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    config.reset_settings()
    yield
    config.reset_settings()


@pytest.fixture
def tinker_url(tinker_env, spawn, monkeypatch) -> str:
    """Base URL of a running Tinker service (gunicorn, one gthread worker)."""
    port = free_port()
    monkeypatch.setenv("TURNSTILE_TINKER_BIND", f"127.0.0.1:{port}")
    config.reset_settings()
    proc = spawn([os.path.join(os.path.dirname(sys.executable), "gunicorn"), "-c", "workers/tinker_conf.py",
                  "app.tinker:create_tinker_app()"], name="tinker")
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, 60, what=lambda: f"the Tinker service to answer:\n{proc.output()[-3000:]}")
    return url


@pytest.fixture
def key():
    """`key(name)`: the Tinker API key of a key name."""
    from app.tinker.keys import key_for

    return key_for
