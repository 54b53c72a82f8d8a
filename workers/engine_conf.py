"""gunicorn config for the embedded engine: `gunicorn -c workers/engine_conf.py` (the Procfile's `engine`).

One worker process owns the model and its batching scheduler thread (a second worker would load a
second copy of the model and split the sessions between two prefix caches); gthread threads serve
the concurrent requests, each holding a thread while it streams.  The app is built in the worker
after the fork (no preload), so the scheduler thread lives in the process that serves.  Settings
(app.config): TURNSTILE_ENGINE_PORT, TURNSTILE_ENGINE_MODEL, TURNSTILE_ENGINE_DTYPE (float32 |
bfloat16), TURNSTILE_ENGINE_THREADS (torch threads), TURNSTILE_LOG_LEVEL.
"""
import faulthandler
import socket

from app.config import get_settings

_settings = get_settings()  # a bad value stops gunicorn here, with the variable's name
bind = f"127.0.0.1:{_settings.engine_port}"
# The engine id is stable across worker restarts (host and port), as `python -m app.engines.embedded.server` makes it.
wsgi_app = f"app.engines.embedded.server:create_engine_app(engine_id='embedded-{socket.gethostname()}-{_settings.engine_port}')"
workers = 1
worker_class = "gthread"
threads = 64
# Generations and prefills of long prompts run for minutes on a CPU; the worker's heartbeat runs
# on its own thread, so this only bounds a worker that stopped answering altogether.
timeout = 600
graceful_timeout = 30
keepalive = 75
errorlog = "-"
loglevel = _settings.log_level.lower()
control_socket_disable = True  # several gunicorn masters share a host


def post_worker_init(worker):
    faulthandler.enable()  # a hard crash (signal) leaves every thread's traceback in the log
