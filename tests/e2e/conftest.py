"""A whole Turnstile deployment as real subprocesses, for end-to-end tests.

REST API (gunicorn), gateway (gunicorn), embedded engine on the tiny model, and
Celery workers per queue (control/prepare/grade, rollout, gpu) on the real Redis,
over a fresh SQLite database migrated with Alembic.  Run outputs go to a temporary
var folder; the expensive caches (sdists, venvs, harness CLIs, the tokenizer) are
shared with the checkout's `var/`.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import httpx
import pytest
from alembic import command
from alembic.config import Config

from app import config, db
from support import AUTH, REDIS_BASE, ROOT, celery_worker_args, free_port, wait_for

E2E_REDIS_DB = 6


@dataclass
class Stack:
    api: httpx.Client
    env: dict
    procs: dict

    def logs(self) -> str:
        return "\n".join(f"===== {name}\n{p.output()[-4000:]}" for name, p in self.procs.items())


@pytest.fixture
def stack(tmp_path, monkeypatch, spawn):
    import redis

    redis.Redis.from_url(f"{REDIS_BASE}/{E2E_REDIS_DB}").flushdb()
    var = tmp_path / "var"
    var.mkdir()
    project_var = ROOT / "var"
    (project_var / "models").mkdir(parents=True, exist_ok=True)
    (var / "models").symlink_to(project_var / "models")
    api_port, gw_port, engine_port = free_port(), free_port(), free_port()
    env = {
        "DATABASE_URL": f"sqlite:///{tmp_path / 'turnstile.db'}",
        "REDIS_URL": f"{REDIS_BASE}/{E2E_REDIS_DB}",
        "TURNSTILE_VAR_DIR": str(var),
        # the process's shared cache (tests/worker_isolation.py: the checkout's var/cache unless set)
        "TURNSTILE_CACHE_DIR": os.environ.get("TURNSTILE_CACHE_DIR") or str(project_var / "cache"),
        "TURNSTILE_TOOLS_DIR": str(project_var / "tools"),
        "TURNSTILE_API_URL": f"http://127.0.0.1:{api_port}",
        "TURNSTILE_API_BIND": f"127.0.0.1:{api_port}",
        "TURNSTILE_GATEWAY_URL": f"http://127.0.0.1:{gw_port}",
        "TURNSTILE_GATEWAY_BIND": f"127.0.0.1:{gw_port}",
        "TURNSTILE_ENGINE_URLS": f"http://127.0.0.1:{engine_port}",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config.reset_settings()
    db.dispose_engine()
    cfg = Config(str(ROOT / "alembic.ini"))
    command.upgrade(cfg, "head")
    bin_dir = os.path.dirname(sys.executable)
    procs = {
        "engine": spawn([sys.executable, "-m", "app.engines.embedded.server", "--model", "tiny", "--port", str(engine_port)], env, "engine"),
        "gateway": spawn([f"{bin_dir}/gunicorn", "-c", "workers/gateway_conf.py", "app.proxy:create_gateway_app()"], env, "gateway"),
        "api": spawn([f"{bin_dir}/gunicorn", "-c", "workers/api_conf.py", "app:create_app()"], env, "api"),
        "cpu": spawn(celery_worker_args("control,prepare,grade", concurrency=3, name="cpu"), env, "cpu"),
        "rollout": spawn(celery_worker_args("rollout", concurrency=6, name="rollout"), env, "rollout"),
        "gpu": spawn(celery_worker_args("gpu", concurrency=1, name="gpu"), env, "gpu"),
    }
    client = httpx.Client(base_url=env["TURNSTILE_API_URL"], timeout=30, headers=AUTH)
    st = Stack(client, env, procs)

    def up():
        try:
            return all(httpx.get(u, timeout=2).status_code == 200 for u in (
                f"{env['TURNSTILE_API_URL']}/api/health", f"{env['TURNSTILE_GATEWAY_URL']}/health",
                f"{env['TURNSTILE_ENGINE_URLS']}/health"))
        except httpx.HTTPError:
            return False

    wait_for(up, 120, interval=0.5, what=lambda: f"the stack to come up\n{st.logs()}")
    yield st
    client.close()
    db.dispose_engine()
    config.reset_settings()
