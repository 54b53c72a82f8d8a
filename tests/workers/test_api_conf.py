"""The REST API under its real gunicorn config delivers every run's control task.

Regression: with several threads per gunicorn worker, kombu's Redis transport lost
some `control.start_run` messages silently (the run stayed `queued` forever).
"""
from __future__ import annotations

import os
import sys

import httpx
from sqlalchemy import select

from app.db import session_scope
from app.tables import Run
from support import AUTH, REDIS_BASE, celery_worker_args, free_port, wait_for

REDIS_DB = 10


def test_every_created_run_is_started(database, redis_db, spawn):
    port = free_port()
    env = {"DATABASE_URL": database, "REDIS_URL": f"{REDIS_BASE}/10", "TURNSTILE_API_BIND": f"127.0.0.1:{port}"}
    spawn(celery_worker_args("control", concurrency=2, name="ctl"), env, "worker")
    api = spawn([f"{os.path.dirname(sys.executable)}/gunicorn", "-c", "workers/api_conf.py", "app:create_app()"], env, "api")
    base = f"http://127.0.0.1:{port}"

    def up():
        try:
            return httpx.get(f"{base}/api/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 60, what=f"the API\n{api.output()}")
    body = {"kind": "eval", "group_size": 1, "simulate": {"episode_median_s": 0.1}, "scheduling": {"rollout_slots": 1}}
    ids = [httpx.post(f"{base}/api/runs", json=body, timeout=30, headers=AUTH).json()["id"] for _ in range(12)]

    def all_started():
        with session_scope() as s:
            return not s.scalars(select(Run.id).where(Run.id.in_(ids), Run.status == "queued")).all()

    wait_for(all_started, 60, what="every run to leave `queued`")
