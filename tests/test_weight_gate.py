"""The weight-reload gate's counters on a real Redis: held requests, held seconds, held now."""
from __future__ import annotations

import time

import pytest
import redis as redis_lib

from app import weight_gate

URL = "http://127.0.0.1:1/"


def test_holding_counts_a_request_while_it_waits_and_as_held_however_it_ends(redis_db):
    assert weight_gate.hold_stats(URL) == {"requests": 0, "seconds": 0.0, "holding": 0}
    with weight_gate.holding(URL) as a, weight_gate.holding(URL.rstrip("/")) as b:  # one engine, however spelt
        assert weight_gate.hold_stats(URL)["holding"] == 2
        time.sleep(0.05)
    assert a.seconds >= 0.05 and b.seconds >= 0.05
    with pytest.raises(GeneratorExit), weight_gate.holding(URL) as gone:  # a stream's client left mid-hold
        raise GeneratorExit
    stats = weight_gate.hold_stats(URL)
    assert stats["requests"] == 3 and stats["holding"] == 0
    assert stats["seconds"] == pytest.approx(a.seconds + b.seconds + gone.seconds)
    weight_gate.record_hold(URL, 1.5)
    assert weight_gate.hold_stats(URL)["requests"] == 4


def test_the_gate_closes_for_a_reload_and_opens_after_it(redis_db):
    weight_gate.reset()
    with weight_gate.reloading(URL, 3):
        assert redis_db.get(weight_gate.gate_key(URL)) == b"3"
        weight_gate.reset()
        assert weight_gate.is_reloading(URL)
        assert not weight_gate.wait_open(URL, timeout_s=0.2, poll_s=0.05)
    assert weight_gate.wait_open(URL, timeout_s=1.0)


def test_a_dead_trainers_gate_opens_after_the_pause_timeout(redis_db, monkeypatch):
    """The gate's key expires after `weight_pause_timeout_s` (capped at GATE_TTL_S): a trainer
    killed inside `reloading` holds the gateway's calls no longer than that."""
    from app import config

    monkeypatch.setenv("TURNSTILE_WEIGHT_PAUSE_TIMEOUT_S", "42.5")
    config.reset_settings()
    try:
        with weight_gate.reloading(URL, 3):
            assert 0 < redis_db.ttl(weight_gate.gate_key(URL)) <= 43
        monkeypatch.setenv("TURNSTILE_WEIGHT_PAUSE_TIMEOUT_S", "86400")
        config.reset_settings()
        with weight_gate.reloading(URL, 4):
            assert weight_gate.GATE_TTL_S - 5 < redis_db.ttl(weight_gate.gate_key(URL)) <= weight_gate.GATE_TTL_S
    finally:
        monkeypatch.undo()
        config.reset_settings()


def test_a_redis_outage_never_fails_the_harness_call(monkeypatch):
    dead = redis_lib.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    monkeypatch.setattr(weight_gate, "_redis", lambda: dead)
    weight_gate.reset()
    assert not weight_gate.is_reloading(URL)  # an unreadable gate counts as open
    with weight_gate.holding(URL):  # neither entering nor leaving the hold raises
        weight_gate.record_hold(URL, 0.1)
