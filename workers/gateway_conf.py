"""gunicorn config for the gateway: `gunicorn -c workers/gateway_conf.py 'app.proxy:create_gateway_app()'`.

gthread workers: each streamed answer holds one thread while it relays the
engine's events (writes are unbuffered, so every SSE event is flushed as it is
yielded).  Threads are cheap; size them for the number of concurrent harness
sessions (TURNSTILE_GATEWAY_THREADS per worker).  Env overrides:
TURNSTILE_GATEWAY_BIND, TURNSTILE_GATEWAY_WORKERS, TURNSTILE_GATEWAY_THREADS.
"""
import os

bind = os.environ.get("TURNSTILE_GATEWAY_BIND", "127.0.0.1:8100")
workers = int(os.environ.get("TURNSTILE_GATEWAY_WORKERS", "2"))
worker_class = "gthread"
threads = int(os.environ.get("TURNSTILE_GATEWAY_THREADS", "64"))
# Long generations and long prefills: the gateway itself never times a request out;
# keep-alive frames keep the client's idle timers fed.
timeout = int(os.environ.get("TURNSTILE_GATEWAY_WORKER_TIMEOUT", "0"))
graceful_timeout = 30
keepalive = 75
backlog = 2048
accesslog = os.environ.get("TURNSTILE_GATEWAY_ACCESS_LOG") or None
errorlog = "-"
loglevel = os.environ.get("TURNSTILE_LOG_LEVEL", "info").lower()


def post_fork(server, worker):
    # No pooled DB connection or HTTP client may cross a fork.
    from app.db import dispose_engine
    from app.proxy.upstream import reset_upstream

    dispose_engine()
    reset_upstream()

# Several gunicorn masters (api, gateway, test gateways) share a host: no shared control socket.
control_socket_disable = True
