"""`celery -A app flower` starts against the real broker and lists a running worker."""
from __future__ import annotations

import sys

import httpx

from support import REDIS_BASE, celery_worker_args, free_port, wait_for

REDIS_DB = 10


def test_flower_lists_the_worker(database, redis_db, spawn):
    env = {"DATABASE_URL": database, "REDIS_URL": f"{REDIS_BASE}/10",
           "FLOWER_UNAUTHENTICATED_API": "true"}  # flower 2 serves its JSON API only with auth or this switch
    worker = spawn(celery_worker_args("control", concurrency=1, name="flowered"), env, name="worker")
    port = free_port()
    flower = spawn([sys.executable, "-m", "celery", "-A", "app", "flower", f"--port={port}", "--address=127.0.0.1"],
                   env, name="flower")

    def listed():
        try:
            workers = httpx.get(f"http://127.0.0.1:{port}/api/workers", params={"refresh": "1"}, timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return None
        return [name for name in workers if name.startswith("flowered-")]

    names = wait_for(listed, 60, interval=1, what=f"flower to list the worker\n{flower.output()[-2000:]}\n{worker.output()[-2000:]}")
    assert len(names) == 1
