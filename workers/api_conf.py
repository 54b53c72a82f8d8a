"""gunicorn settings for the REST API (:8000).

One thread per worker process, on purpose: the API enqueues Celery tasks, and
kombu's Redis transport silently dropped messages published from several threads
of one process (measured here: 4 of 10 `control.start_run` messages lost with
gthread × 4 threads, 10 of 10 delivered with one thread; tests/workers/
test_api_conf.py guards it).  Concurrency comes from worker processes.
Settings (app.config): TURNSTILE_API_BIND, TURNSTILE_API_WORKERS, TURNSTILE_LOG_LEVEL.
"""
from app.config import get_settings

_settings = get_settings()  # a bad value stops gunicorn here, with the variable's name
bind = _settings.api_bind
worker_class = "gthread"
workers = _settings.api_workers
threads = 1
timeout = 120
graceful_timeout = 20
max_requests = 2000
max_requests_jitter = 200
accesslog = None
loglevel = _settings.log_level.lower()
# Several gunicorn masters (api, gateway, test servers) share a host: no shared control socket.
control_socket_disable = True
