"""gunicorn config for the gateway: `gunicorn -c workers/gateway_conf.py 'app.proxy:create_gateway_app()'`.

gthread workers: each streamed answer holds one thread while it relays the
engine's events, reading the engine's socket and writing the client's on that one
thread (writes are unbuffered, so every SSE event is flushed as it is yielded).
gevent has not been measured against it: it is not installed, and its patching
removes select.poll, which the stream reader uses (figures: docs/benchmarks.md).  Threads are cheap; size them for the number of concurrent harness
sessions (TURNSTILE_GATEWAY_THREADS per worker).  Settings (app.config):
TURNSTILE_GATEWAY_BIND, TURNSTILE_GATEWAY_WORKERS, TURNSTILE_GATEWAY_THREADS,
TURNSTILE_GATEWAY_WORKER_TIMEOUT, TURNSTILE_GATEWAY_ACCESS_LOG, TURNSTILE_LOG_LEVEL.
"""
import os

from app.config import get_settings

_settings = get_settings()  # a bad value stops gunicorn here, with the variable's name
bind = _settings.gateway_bind
workers = _settings.gateway_workers
worker_class = "gthread"
threads = _settings.gateway_threads
# Long generations and long prefills: the gateway itself never times a request out;
# keep-alive frames keep the client's idle timers fed.
timeout = _settings.gateway_worker_timeout
graceful_timeout = 30
keepalive = 75
backlog = 2048
# The worker heartbeat touches a file in worker_tmp_dir on every turn of the worker's event loop
# (about twice per request); on a disk-backed /tmp that cost 0.4 ms per request here. gunicorn's
# docs advise a memory filesystem: https://docs.gunicorn.org/en/stable/settings.html#worker-tmp-dir
worker_tmp_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
accesslog = _settings.gateway_access_log
logger_class = "workers.redacting_logger.RedactingLogger"  # session keys never reach the access log
errorlog = "-"
loglevel = _settings.log_level.lower()


def post_fork(server, worker):
    # No pooled DB connection or HTTP client may cross a fork.
    from app.db import dispose_engine
    from app.proxy.upstream import get_upstream, reset_upstream

    dispose_engine()
    reset_upstream()
    get_upstream()  # build the engine clients now, not during the first harness call

# Several gunicorn masters (api, gateway, test gateways) share a host: no shared control socket.
control_socket_disable = True
