"""gunicorn config for the gateway: `gunicorn -c workers/gateway_conf.py 'app.proxy:create_gateway_app()'`.

Worker class (TURNSTILE_GATEWAY_WORKER_CLASS): gevent by default, gthread on request.  Each
streamed answer reads the engine's socket and writes the client's on one thread (gthread) or
greenlet (gevent); writes are unbuffered, so every SSE event is flushed as it is yielded.  With
gevent the worker is one OS thread switching greenlets at socket waits: no GIL hand-off between
threads per read and write: 28-40 against 47-61 µs of CPU per streamed token from 16 to 256
sessions at 2,000 tokens/s, 68-115 against 121-165 at 200 tokens/s from 16 to 64, on a quiet 2-core
box, though more at one fast session (60-83 against 53-66; bench/gateway.py --token-rate,
docs/benchmarks.md).  Its patching makes
select.poll, sockets, locks and time.sleep cooperative; psycopg 3 (>= 3.1.14) and redis-py
cooperate as they are.  A long CPU burst in one request (a big body's JSON) holds the worker's
other streams for its length, where gthread would interleave them every 5 ms (the GIL's switch
interval).  Settings (app.config): TURNSTILE_GATEWAY_BIND, TURNSTILE_GATEWAY_WORKERS,
TURNSTILE_GATEWAY_WORKER_CLASS, TURNSTILE_GATEWAY_THREADS, TURNSTILE_GATEWAY_WORKER_TIMEOUT,
TURNSTILE_GATEWAY_ACCESS_LOG, TURNSTILE_LOG_LEVEL.
"""
import os

from app.config import get_settings

_settings = get_settings()  # a bad value stops gunicorn here, with the variable's name
bind = _settings.gateway_bind
workers = _settings.gateway_workers
worker_class = _settings.gateway_worker_class
threads = _settings.gateway_threads  # gthread: threads per worker (gevent: a greenlet per connection,
# up to gunicorn's worker_connections, 1000 by default; gthread keeps idle keep-alive connections in
# its poller beyond its threads, up to the same bound)
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


def post_worker_init(worker):
    # After the worker loaded the app (and, for gevent, after its monkey-patching: post_fork runs
    # before it, and a module imported there would keep the unpatched socket and locks).
    # No pooled DB connection or HTTP client may cross a fork.
    from app.db import dispose_engine
    from app.proxy.upstream import get_upstream, reset_upstream

    dispose_engine()
    reset_upstream()
    get_upstream()  # build the engine clients now, not during the first harness call

# Several gunicorn masters (api, gateway, test gateways) share a host: no shared control socket.
control_socket_disable = True
