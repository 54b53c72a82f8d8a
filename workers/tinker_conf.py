"""gunicorn settings for the Tinker service (:8300, `app.tinker:create_tinker_app()`).

gthread workers: `retrieve_future` waits up to 2 s for a future to finish before answering
try_again, so a worker serves several polls at once; the Celery messages of one process are sent
one at a time (app.tinker.routes_ops), which keeps kombu's Redis transport to one publishing
thread (workers/api_conf.py says why that matters).
Settings (app.config): TURNSTILE_TINKER_BIND, TURNSTILE_TINKER_WORKERS, TURNSTILE_LOG_LEVEL.
"""
from app.config import get_settings

_settings = get_settings()
bind = _settings.tinker_bind
worker_class = "gthread"
workers = _settings.tinker_workers
threads = 8
timeout = 120
graceful_timeout = 20
accesslog = None
loglevel = _settings.log_level.lower()
control_socket_disable = True
