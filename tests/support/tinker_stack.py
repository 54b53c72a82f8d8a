"""A whole Tinker deployment as real processes: the Tinker service (gunicorn), the embedded engine
on a model, the gpu worker (`workers.gpu_worker`: the trainer's ops) and a rollout worker
(sampling), on the real Redis and the test's SQLite database.  Used by the SDK's end-to-end tests
and the cookbook recipe tests (`stack` fixtures there)."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from support import REDIS_BASE, celery_worker_args, free_port, wait_for
from support.engine_process import EngineProcess


# The stack's own broker DB: tests of the service alone flush theirs (DB 12) when they start and
# end, which deleted this stack's queued messages when both ran at once (a future stayed pending).
STACK_REDIS_DB = 4


@dataclass
class TinkerStack:
    url: str           # the SDK's base_url
    engine: EngineProcess
    procs: dict

    def logs(self) -> str:
        out = [f"===== {name}\n{p.output()[-4000:]}" for name, p in self.procs.items()]
        self.engine.log.flush()
        with open(self.engine.log.name, errors="replace") as log:
            out.append(f"===== engine\n{log.read()[-3000:]}")
        return "\n".join(out)


def start_stack(request, spawn, monkeypatch, model: str = "tiny", keys: dict | None = None) -> TinkerStack:
    """Start the engine, then the service and the workers pointed at it (module docstring)."""
    from app import config

    import redis

    request.getfixturevalue("tinker_env")  # its settings first: `keys` and the broker replace its own
    broker = f"{REDIS_BASE}/{STACK_REDIS_DB}"
    redis.Redis.from_url(broker).flushdb()
    monkeypatch.setenv("REDIS_URL", broker)
    engine = EngineProcess(model)
    request.addfinalizer(engine.stop)
    monkeypatch.setenv("TURNSTILE_ENGINE_URLS", engine.url)
    if keys is not None:
        monkeypatch.setenv("TURNSTILE_TINKER_KEYS", json.dumps(keys))
    config.reset_settings()
    url = request.getfixturevalue("tinker_url")
    procs = {
        "gpu": spawn([sys.executable, "-m", "workers.gpu_worker", "--loglevel", "INFO", "-n", f"gpu-{free_port()}@%h"],
                     name="gpu"),
        "rollout": spawn(celery_worker_args("rollout", concurrency=2, name="rollout"), name="rollout"),
    }
    stack = TinkerStack(url, engine, procs)
    wait_for(lambda: all("ready." in p.output() for p in procs.values()), 120,
             what=lambda: f"the workers to be ready\n{stack.logs()}")
    assert os.environ["TURNSTILE_ENGINE_URLS"] == engine.url
    return stack
