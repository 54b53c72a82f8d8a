"""The control loop's Redis state: key names and every operation on them, in one place.

All of it is rebuilt from SQL by the watchdog (`app.control.reaper.rebuild_redis_state`):
a missing `turnstile:state:marker` says Redis lost its data (restarted without it, or
flushed), and every READY buffer, slot list and cancel flag is then written again from
the episodes' rows; a READY buffer that differs from the run's `ready` episodes is
rewritten on any pass:

    turnstile:state:marker          str    set by the watchdog once Redis holds the state SQL implies

    turnstile:run:<id>:ready        list   prepared episode ids waiting for a rollout slot (READY buffer)
    turnstile:run:<id>:slot_free    list   unix times at which a rollout slot became free
    turnstile:run:<id>:slot_wait    hash   episode id -> time its slot became free
    turnstile:run:<id>:ready_waits  list   measured READY waits (s): slot free -> rollout started
    turnstile:run:<id>:dirty        str    "a tick is wanted" mark (see app.control.scheduler.tick)
    turnstile:run:<id>:lock         lock   held by the process running the run's tick
    turnstile:episode:<id>:cancel   str    set when the scheduler cancelled the episode
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator

from redis.exceptions import RedisError

from app.redis_client import get_redis, held_lock

log = logging.getLogger(__name__)

CANCEL_TTL_S = 24 * 3600
DIRTY_TTL_MS = 600_000
RUN_LOCK_TIMEOUT_S = 30.0


def ready_key(run_id: int) -> str:
    return f"turnstile:run:{run_id}:ready"


def slot_free_key(run_id: int) -> str:
    return f"turnstile:run:{run_id}:slot_free"


def slot_wait_key(run_id: int) -> str:
    return f"turnstile:run:{run_id}:slot_wait"


def ready_waits_key(run_id: int) -> str:
    return f"turnstile:run:{run_id}:ready_waits"


def dirty_key(run_id: int) -> str:
    return f"turnstile:run:{run_id}:dirty"


def run_lock_key(run_id: int) -> str:
    return f"turnstile:run:{run_id}:lock"


def cancel_key(episode_id: int) -> str:
    return f"turnstile:episode:{episode_id}:cancel"


MARKER_KEY = "turnstile:state:marker"


def has_marker() -> bool:
    """True while Redis still holds what the watchdog last rebuilt or checked (no data loss since)."""
    return bool(get_redis().exists(MARKER_KEY))


def set_marker() -> None:
    get_redis().set(MARKER_KEY, time.time())


# --- the run lock and the dirty mark --------------------------------------------------


@contextlib.contextmanager
def run_lock(run_id: int) -> Iterator[bool]:
    """Try to hold the run's tick lock (redis-py `Lock`, extended while held); yields whether held."""
    with held_lock(run_lock_key(run_id), RUN_LOCK_TIMEOUT_S) as held:
        yield held


def mark_dirty(run_id: int) -> None:
    get_redis().set(dirty_key(run_id), 1, px=DIRTY_TTL_MS)


def take_dirty(run_id: int) -> bool:
    """Clear the run's dirty mark; True if it was set."""
    return bool(get_redis().getdel(dirty_key(run_id)))


def is_dirty(run_id: int) -> bool:
    return bool(get_redis().exists(dirty_key(run_id)))


# --- READY buffer and rollout slots ---------------------------------------------------


def push_ready(run_id: int, episode_id: int) -> None:
    """Put a prepared episode into the run's READY buffer."""
    get_redis().lpush(ready_key(run_id), episode_id)


def pop_ready(run_id: int) -> int | None:
    """Take the oldest prepared episode id from the READY buffer, or None when it is empty."""
    raw = get_redis().rpop(ready_key(run_id))
    return None if raw is None else int(raw)


def clear_ready(run_id: int) -> None:
    get_redis().delete(ready_key(run_id))


def ready_ids(run_id: int) -> list[int]:
    """The READY buffer's episode ids, oldest (next to pop) first."""
    return [int(x) for x in reversed(get_redis().lrange(ready_key(run_id), 0, -1))]


def set_ready(run_id: int, episode_ids: list[int]) -> None:
    """Replace the READY buffer with `episode_ids`, oldest (next to pop) first, in one transaction."""
    pipe = get_redis().pipeline()
    pipe.delete(ready_key(run_id))
    if episode_ids:
        pipe.lpush(ready_key(run_id), *episode_ids)
    pipe.execute()


def reset_slots(run_id: int, free: int, running: list[int]) -> None:
    """Slot bookkeeping after a loss: `free` slots freed now, no READY wait pending for an episode
    that is not in `running` (the READY-wait clock of a lost slot restarts at the rebuild)."""
    r = get_redis()
    waiting = [int(k) for k in r.hkeys(slot_wait_key(run_id))]
    pipe = r.pipeline()
    pipe.delete(slot_free_key(run_id))
    if free > 0:
        pipe.rpush(slot_free_key(run_id), *([time.time()] * free))
    stale = [k for k in waiting if k not in set(running)]
    if stale:
        pipe.hdel(slot_wait_key(run_id), *stale)
    pipe.execute()


def slots_free(run_id: int) -> int:
    """Freed slots not yet refilled (entries of the slot-free list)."""
    return int(get_redis().llen(slot_free_key(run_id)))


def free_slot(run_id: int) -> None:
    """Note that one of the run's rollout slots just became free (for the READY-wait metric)."""
    get_redis().rpush(slot_free_key(run_id), time.time())


def assign_slot(run_id: int, episode_id: int) -> None:
    """The episode takes a freed slot: remember since when that slot waited."""
    r = get_redis()
    freed = r.lpop(slot_free_key(run_id))
    if freed is not None:
        r.hset(slot_wait_key(run_id), episode_id, freed)


def record_ready_wait(run_id: int, episode_id: int) -> None:
    """READY wait: seconds from the moment the episode's slot was freed to its rollout's start."""
    r = get_redis()
    freed = r.hget(slot_wait_key(run_id), episode_id)
    if freed is not None:
        r.hdel(slot_wait_key(run_id), episode_id)
        r.rpush(ready_waits_key(run_id), max(0.0, time.time() - float(freed)))


def take_ready_waits(run_id: int) -> list[float]:
    """The READY waits (s) measured since the last call, and forget them."""
    r = get_redis()
    pipe = r.pipeline()
    pipe.lrange(ready_waits_key(run_id), 0, -1)
    pipe.delete(ready_waits_key(run_id))
    raw, _ = pipe.execute()
    return [float(w) for w in raw]


def ready_waits(run_id: int) -> list[float]:
    """The READY waits (s) measured since the last training step (read-only)."""
    return [float(w) for w in get_redis().lrange(ready_waits_key(run_id), 0, -1)]


# --- cancel flags ---------------------------------------------------------------------


def flag_cancelled(episode_id: int) -> None:
    """Tell the episode's rollout (in whatever process) to stop."""
    get_redis().set(cancel_key(episode_id), 1, ex=CANCEL_TTL_S)


def missing_cancel_flags(episode_ids: list[int]) -> list[int]:
    """Those of `episode_ids` whose cancel flag is not set."""
    if not episode_ids:
        return []
    pipe = get_redis().pipeline()
    for episode_id in episode_ids:
        pipe.exists(cancel_key(episode_id))
    return [e for e, present in zip(episode_ids, pipe.execute()) if not present]


def forget_episodes(episode_ids: list[int]) -> None:
    """Delete the Redis state of episodes whose rows were just created.  Row ids restart when
    the SQL database is replaced (a fresh SQLite file, a new checkout) while Redis keeps its
    keys, so a new episode must never inherit an old one's cancel flag."""
    if episode_ids:
        get_redis().delete(*(cancel_key(e) for e in episode_ids))


def forget_run(run_id: int) -> None:
    """Delete the Redis state of a run that is starting for the first time (READY buffer, slots,
    waits, dirty mark): stale keys of an earlier database's run with the same id would give it
    phantom READY episodes or slots."""
    get_redis().delete(ready_key(run_id), slot_free_key(run_id), slot_wait_key(run_id), ready_waits_key(run_id),
                       dirty_key(run_id))


def is_cancelled(episode_id: int) -> bool:
    """True once the scheduler cancelled the episode (straggler cut or run cancel)."""
    return bool(get_redis().exists(cancel_key(episode_id)))


def cancel_polled(episode_id: int) -> bool:
    """`is_cancelled` for a poll that asks again within seconds: a Redis error (timeout, lost
    connection) reads as "not cancelled" and is logged, so a stall of Redis does not end the
    rollout that polls; the next poll asks again.  (A box short of memory stalled Redis replies
    past the client's socket timeout and every polling rollout failed at once.)"""
    try:
        return is_cancelled(episode_id)
    except RedisError as exc:
        log.warning("episode=%s event=cancel_poll_failed error=%s: %s", episode_id, type(exc).__name__, exc)
        return False
