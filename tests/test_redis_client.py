"""Redis locks (redis-py `Lock` through `app.redis_client.held_lock`) on a real Redis, across processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import redis as redis_lib

from app.control import redis_state
from app.redis_client import held_lock
from support import REDIS_BASE, ROOT, wait_for

REDIS_DB = 11
REDIS_URL = f"{REDIS_BASE}/{REDIS_DB}"

# Each child takes run 7's tick lock as often as it can for `seconds`, and logs when it
# enters and leaves the critical section.
_CONTENDER = """
import os, sys, time
from app.control import redis_state
from app.redis_client import get_redis
r = get_redis()
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    with redis_state.run_lock(7) as held:
        if held:
            r.rpush("events", f"in:{os.getpid()}")
            time.sleep(0.02)
            r.rpush("events", f"out:{os.getpid()}")
"""


def _extensions(r, key: str, times: int) -> None:
    """Until the lock `key` has been extended `times` times: its remaining time went back up
    (polled every 20 ms; the keeper extends every third of the timeout).  Counted in
    extensions, so a loaded box that slows the keeper slows this wait, not the test's verdict;
    AssertionError after 60 s."""
    seen, last = [], r.pttl(key)

    def extended() -> bool:
        nonlocal last
        now = r.pttl(key)
        if now > last:
            seen.append(now)
        last = now
        return len(seen) >= times

    wait_for(extended, 60, interval=0.02, what=lambda: f"{times} extensions of {key} (seen {len(seen)})")


def _child(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "REDIS_URL": REDIS_URL, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=env)


def test_two_processes_never_hold_the_run_lock_at_once(redis_db, monkeypatch):
    procs = [_child(_CONTENDER, "3") for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=60) == 0
    events = [e.decode() for e in redis_db.lrange("events", 0, -1)]
    holders = {e.split(":")[1] for e in events}
    assert len(holders) == 2, "both processes should have held the lock at some point"
    # Strict alternation in:X, out:X, in:Y, out:Y ...: nobody entered while another was inside.
    for k in range(0, len(events), 2):
        assert events[k].startswith("in:") and events[k + 1] == "out:" + events[k][3:], events[k:k + 2]
    assert not redis_db.exists(redis_state.run_lock_key(7))  # released


def test_a_lock_held_longer_than_its_timeout_is_extended(redis_db, monkeypatch):
    monkeypatch.setenv("REDIS_URL", REDIS_URL)
    from app import config

    config.reset_settings()
    with held_lock("turnstile:test:long", timeout_s=0.6) as held:
        assert held
        # four extensions, a third of the timeout apart: held past its timeout (4/3 of it)
        _extensions(redis_db, "turnstile:test:long", 4)
        with held_lock("turnstile:test:long", timeout_s=0.6) as second:
            assert not second
    with held_lock("turnstile:test:long", timeout_s=0.6) as again:
        assert again  # released on exit
    config.reset_settings()


def test_a_dead_holders_lock_expires_and_a_live_holders_is_never_freed_by_another(redis_db, monkeypatch):
    monkeypatch.setenv("REDIS_URL", REDIS_URL)
    from app import config

    config.reset_settings()
    holder = _child("from app.redis_client import held_lock\nimport time\n"
                    "with held_lock('turnstile:test:dead', timeout_s=1.0) as h:\n"
                    "    assert h\n    print('held', flush=True)\n    time.sleep(60)\n")
    wait_for(lambda: redis_db.exists("turnstile:test:dead"), 20, what="the child to take the lock")
    _extensions(redis_db, "turnstile:test:dead", 4)  # the child's keeper extends it past its 1 s timeout
    token = redis_db.get("turnstile:test:dead")
    with held_lock("turnstile:test:dead", timeout_s=1.0) as mine:
        assert not mine
    assert redis_db.get("turnstile:test:dead") == token  # our failed attempt did not delete the child's lock
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=10)
    wait_for(lambda: not redis_db.exists("turnstile:test:dead"), 5, what="the dead holder's lock to expire")
    with held_lock("turnstile:test:dead", timeout_s=1.0) as mine:
        assert mine
    config.reset_settings()


def test_redis_down_raises_instead_of_pretending_to_hold(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    from app import config

    config.reset_settings()
    try:
        raised = False
        try:
            with held_lock("turnstile:test:down"):
                pass
        except redis_lib.RedisError:
            raised = True
        assert raised
    finally:
        config.reset_settings()
