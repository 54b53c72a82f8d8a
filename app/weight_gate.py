"""The weight-reload gate shared by the trainer and the gateway.

While an engine loads new weights, the trainer holds a Redis key
`turnstile:engine:<url>:reloading` (value: the policy version being loaded, with a
TTL so a dead trainer cannot close the gate forever).  The gateway checks the key
before sending a new request to that engine and holds the request (streams get
keep-alives) until the key is gone; requests already running finish on the old
weights and keep the old version stamp.  Held requests and held seconds are
counted per engine, so runs can report how long harness calls waited, and so is the
number of requests being held right now.

A vLLM engine's pause for a weight update is recorded too (`record_pause`, one hash of every
engine paused now), before it is asked for and until `/resume` answered, so a pause whose
reloader died is found and ended by the watchdog (`app.control.engine_pauses`).
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import redis as redis_lib

from app.config import get_settings
from app.redis_client import get_redis

GATE_TTL_S = 600
CACHE_S = 0.1  # a request in the first 100 ms of a reload reaches the engine, which holds it itself

_cache: dict[str, tuple[float, bool]] = {}
_lock = threading.Lock()


def _redis() -> redis_lib.Redis:
    return get_redis()


def reset() -> None:
    """Forget the cached gate states (tests change Redis between cases)."""
    _cache.clear()


def gate_key(engine_url: str) -> str:
    return f"turnstile:engine:{engine_url.rstrip('/')}:reloading"


def stats_key(engine_url: str) -> str:
    return f"turnstile:engine:{engine_url.rstrip('/')}:held"


@contextlib.contextmanager
def reloading(engine_url: str, policy_version: int) -> Iterator[None]:
    """Close the gate of `engine_url` for the duration of a weight reload (trainer side).  The key
    expires after `weight_pause_timeout_s` (at most `GATE_TTL_S`), so a trainer killed mid-reload
    holds the gateway's calls no longer than a vLLM pause may last; past it a call reaches the
    engine, which holds it itself while its own reload is pending."""
    r = _redis()
    r.set(gate_key(engine_url), policy_version, ex=max(1, min(GATE_TTL_S, math.ceil(get_settings().weight_pause_timeout_s))))
    try:
        yield
    finally:
        r.delete(gate_key(engine_url))


def updates_key(engine_url: str) -> str:
    return f"turnstile:engine:{engine_url.rstrip('/')}:updates"


UPDATES_KEPT = 64  # an engine's newest weight updates kept for stamping (far more than one completion spans)


def record_update(engine_url: str, policy_version: int, paused_at: float, resumed_at: float) -> None:
    """Note that `engine_url` (one that stamps no versions itself: vLLM) was paused from `paused_at`
    to `resumed_at` (wall-clock seconds) to load `policy_version`; the gateway splits a stream's
    tokens at the middle of the pause (`app.versions.from_arrivals`).  Redis errors propagate."""
    r = _redis()
    pipe = r.pipeline()
    pipe.rpush(updates_key(engine_url), f"{int(policy_version)} {(paused_at + resumed_at) / 2:.6f}")
    pipe.ltrim(updates_key(engine_url), -UPDATES_KEPT, -1)
    pipe.execute()


PAUSES_KEY = "turnstile:engine:pauses"  # hash: engine url -> "<policy version> <paused at>" while paused


def record_pause(engine_url: str, policy_version: int, paused_at: float) -> str:
    """Note, before asking it, that `engine_url` (vLLM) is being paused at `paused_at` (wall-clock
    seconds) to load `policy_version`; returns the stored value, for `clear_pause`.  Written before
    the pause so that no pause goes unrecorded, whatever kills the reloader after it: the watchdog
    resumes an engine whose record is older than `weight_pause_timeout_s`
    (`app.control.engine_pauses`).  Redis errors propagate (a pause nobody could undo is not started)."""
    value = f"{int(policy_version)} {paused_at:.6f}"
    _redis().hset(PAUSES_KEY, engine_url.rstrip("/"), value)
    return value


_CLEAR_IF_SAME = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


def clear_pause(engine_url: str, value: str) -> bool:
    """Forget the engine's pause record if it is still `value` (a newer update's record stays);
    True when it was removed.  Compare and delete run in one Lua script (atomic in Redis)."""
    return bool(_redis().eval(_CLEAR_IF_SAME, 1, PAUSES_KEY, engine_url.rstrip("/"), value))


def recorded_pauses() -> dict[str, tuple[int, float, str]]:
    """`{engine url: (policy version, paused at, stored value)}` of every pause not yet known to
    have ended.  Redis errors propagate."""
    out = {}
    for url, raw in _redis().hgetall(PAUSES_KEY).items():
        value = raw.decode()
        version, paused_at = value.split()
        out[url.decode()] = (int(version), float(paused_at), value)
    return out


def recorded_updates(engine_url: str) -> list[tuple[int, float]]:
    """`(policy version, split time)` of the engine's recorded weight updates, oldest first
    (empty when none was recorded or Redis cannot be read: never fail a harness call for it)."""
    try:
        raw = _redis().lrange(updates_key(engine_url), 0, -1)
    except redis_lib.RedisError:
        return []
    out = []
    for item in raw:
        version, split = item.decode().split()
        out.append((int(version), float(split)))
    return out


def is_reloading(engine_url: str) -> bool:
    """True while the engine's gate is closed (cached for 100 ms per process; False if Redis is down)."""
    now = time.monotonic()
    hit = _cache.get(engine_url)
    if hit is not None and now - hit[0] < CACHE_S:
        return hit[1]
    try:
        closed = bool(_redis().exists(gate_key(engine_url)))
    except redis_lib.RedisError:
        closed = False  # never fail a harness call because the gate cannot be read
    with _lock:
        _cache[engine_url] = (now, closed)
    return closed


def wait_open(engine_url: str, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Block until the gate is open or `timeout_s` passed; returns True when open."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _cache.pop(engine_url, None)
        if not is_reloading(engine_url):
            return True
        time.sleep(poll_s)
    return not is_reloading(engine_url)


@dataclass
class Hold:
    """One request held at the gateway; `seconds` is set when the hold ends."""
    seconds: float = 0.0


@contextlib.contextmanager
def holding(engine_url: str) -> Iterator[Hold]:
    """Hold one request at the gateway while the body runs (it waits for the gate to open).

    While it runs the request counts in `hold_stats(...)["holding"]`; when it ends, however it
    ends (a stream's client may leave mid-hold, closing its generator), it counts as one held
    request with its held seconds, and `Hold.seconds` says how long.  The held-now count is a
    Redis counter: a gateway killed mid-hold leaves it one high until the stats key is deleted,
    so it is a gauge for watching a reload, not an invariant.  Redis errors are swallowed:
    never fail a harness call because the counts cannot be kept."""
    hold, t0 = Hold(), time.perf_counter()
    counted = _count(engine_url, holding=1)
    try:
        yield hold
    finally:
        hold.seconds = time.perf_counter() - t0
        _count(engine_url, holding=-1 if counted else 0, requests=1, seconds=hold.seconds)


def record_hold(engine_url: str, held_s: float) -> None:
    """Count one held request and its held seconds for the engine (what `holding` does at its end)."""
    _count(engine_url, requests=1, seconds=held_s)


def _count(engine_url: str, holding: int = 0, requests: int = 0, seconds: float = 0.0) -> bool:
    """Add to the engine's hold counters in one round trip, atomically (MULTI/EXEC: a reader never
    sees a hold given back but not yet counted); False when Redis cannot be written."""
    key = stats_key(engine_url)
    try:
        pipe = _redis().pipeline()
        if holding:
            pipe.hincrby(key, "holding", holding)
        if requests:
            pipe.hincrby(key, "requests", requests)
            pipe.hincrbyfloat(key, "seconds", seconds)
        pipe.execute()
        return True
    except redis_lib.RedisError:
        return False


def hold_stats(engine_url: str) -> dict:
    """{"requests": n, "seconds": s, "holding": k}: requests held at the gateway for this engine
    so far, their held seconds, and how many are being held now."""
    raw = _redis().hgetall(stats_key(engine_url))
    return {"requests": int(raw.get(b"requests", 0)), "seconds": float(raw.get(b"seconds", 0.0)),
            "holding": int(raw.get(b"holding", 0))}
