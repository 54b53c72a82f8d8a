"""The process's one Redis client, and locks built on redis-py's `Lock`.

Redis holds what can be rebuilt from SQL: Celery's queues, the READY buffers, slot
bookkeeping, cancel flags, the weight-reload gate, the grading cache and locks.  Every
module that needs Redis takes this client, so a process opens one connection pool for
`REDIS_URL`, and a forked child (Celery prefork, gunicorn) opens its own instead of sharing
the parent's sockets.

Locks: `held_lock` wraps `redis.lock.Lock` (a random token per holder, release and extend
by Lua script so they are atomic, https://redis.io/docs/latest/develop/use/patterns/distributed-locks/)
and keeps extending the lock from a background thread while the holder works, so a holder
that runs longer than the expiry keeps it, and a holder that dies loses it after at most
`timeout_s`.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

import redis as redis_lib
from redis.exceptions import LockError

from app.config import get_settings

_client: redis_lib.Redis | None = None
_client_key: tuple[int, str] | None = None  # (pid, url) the client was made for


def get_redis() -> redis_lib.Redis:
    """The client for `get_settings().redis_url` (created on first use; a new one after fork
    or when the configured URL changed).

    Socket timeouts keep a dead Redis from hanging a caller (the gateway asks it on every
    request): connect 2 s, reads 10 s.
    """
    global _client, _client_key
    key = (os.getpid(), get_settings().redis_url)
    if _client is None or _client_key != key:
        _client = redis_lib.Redis.from_url(key[1], socket_connect_timeout=2, socket_timeout=10,
                                           health_check_interval=30)
        _client_key = key
    return _client


@contextlib.contextmanager
def held_lock(name: str, timeout_s: float = 30.0) -> Iterator[bool]:
    """Try once to take the Redis lock `name`; yield whether this caller holds it.

    While held, a daemon thread extends the lock back to `timeout_s` every `timeout_s / 3`
    seconds (`Lock.reacquire`), so work longer than `timeout_s` keeps it.  Release is atomic
    and only frees the lock if this holder's token is still there.  A holder whose process
    dies stops extending; the lock expires `timeout_s` later.

    Raises `redis.RedisError` when Redis cannot be reached.
    """
    lock = get_redis().lock(name, timeout=timeout_s, blocking=False, thread_local=False)
    if not lock.acquire(blocking=False):
        yield False
        return
    stop = threading.Event()

    def _extend() -> None:
        while not stop.wait(timeout_s / 3):
            try:
                lock.reacquire()
            except (LockError, redis_lib.RedisError):
                return  # lost (expired or Redis gone): the holder finishes, another may take over

    keeper = threading.Thread(target=_extend, name=f"lock-keeper:{name}", daemon=True)
    keeper.start()
    try:
        yield True
    finally:
        stop.set()
        keeper.join(timeout=5)
        try:
            lock.release()
        except LockError:
            pass  # it expired and may belong to someone else now: never delete another holder's lock
