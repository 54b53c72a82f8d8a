"""Retry a write through a database or Redis blip instead of throwing away the work before it.

A stage's or step's closing write (the row that records a finished prepare, rollout, grade or
training step) can meet a dropped connection: PostgreSQL restarted or failed over, SQLite's
file locked past its busy timeout, Redis restarted.  Those errors say nothing about the work,
so the write is tried again with exponential backoff until a deadline (the caller's lease);
any other error, and a transient one past the deadline, is raised as it came.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

import redis.exceptions
import sqlalchemy.exc

log = logging.getLogger("turnstile.retry")

T = TypeVar("T")

# Connection-level failures: sqlalchemy's OperationalError (the DBAPI lost or could not get its
# connection, or SQLite's "database is locked") and DisconnectionError (the pool's ping found the
# connection dead); redis-py's ConnectionError (including BusyLoadingError, a Redis still loading
# its data after a restart) and TimeoutError.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    sqlalchemy.exc.OperationalError, sqlalchemy.exc.DisconnectionError,
    redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
)


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` is a dropped or refused database/Redis connection (`TRANSIENT_ERRORS`)."""
    return isinstance(exc, TRANSIENT_ERRORS)


def retry_transient(fn: Callable[[], T], *, deadline_s: float, what: str, first_delay_s: float = 0.1,
                    max_delay_s: float = 2.0, on_retry: Callable[[BaseException], None] | None = None) -> T:
    """Call `fn()` until it returns, retrying transient errors for at most `deadline_s` seconds.

    Waits `first_delay_s`, then twice as long each time up to `max_delay_s`, between tries
    (never past the deadline).  `fn` must be safe to call again after a transient error: one
    transaction (`session_scope`) that rolled back, or an idempotent Redis command.  `on_retry`
    is called with each error retried.  Raises the last transient error once `deadline_s`
    has passed, and any other error at once.
    """
    deadline = time.monotonic() + deadline_s
    delay = first_delay_s
    tries = 0
    while True:
        tries += 1
        try:
            return fn()
        except TRANSIENT_ERRORS as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                log.error("event=retry_gave_up what=%s tries=%s error=%s", what, tries, str(exc).split("\n")[0])
                raise
            log.warning("event=retry what=%s try=%s error=%s", what, tries, str(exc).split("\n")[0])
            if on_retry is not None:
                on_retry(exc)
            time.sleep(min(delay, left))
            delay = min(delay * 2, max_delay_s)
