"""Celery tasks. Each is thin: it loads ids and calls plain functions elsewhere.

Task names are explicit (`<queue>.<verb>`) so moving a function never orphans
messages already queued; routes in app/celery.py key on the prefix.
"""

# Importing the Celery app makes it the current app, so `shared_task`s sent from
# any process (the API, a worker, a test) go to Turnstile's broker, not a default one.
from app.celery import app as celery_app  # noqa: E402,F401
