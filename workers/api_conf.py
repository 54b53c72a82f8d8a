"""gunicorn settings for the REST API (:8000). Sync-style work, short requests; gthread copes with exports."""
import os

bind = os.environ.get("TURNSTILE_API_BIND", "127.0.0.1:8000")
worker_class = "gthread"
workers = int(os.environ.get("TURNSTILE_API_WORKERS", "2"))
threads = 4
timeout = 120
graceful_timeout = 20
max_requests = 2000
max_requests_jitter = 200
accesslog = None
