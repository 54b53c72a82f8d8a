"""A stage's lease renewal through a real PostgreSQL outage: the renewal that met it is tried again
as soon as the database is back, not one renewal interval later (a lease lost to a blip hands
finished work to the reaper)."""
from __future__ import annotations

import threading

import pytest

from app.control import lease
from app.db import session_scope
from app.tables import Episode, Run, TaskInstance, aware_utc
from support import wait_for
from support.faults import cut_database, postgres_process_env, restore_database


@pytest.fixture
def postgres(pg_url, monkeypatch, tmp_path):
    """A fresh PostgreSQL database; leases of 9 s renewed every 3 s."""
    yield from postgres_process_env(pg_url, monkeypatch, tmp_path, TURNSTILE_LEASE_TTL_S="9",
                                    TURNSTILE_LEASE_RENEW_S="3")


def _expiry(episode_id: int):
    with session_scope() as s:
        return aware_utc(s.get(Episode, episode_id).lease_expires_at)


class _Waits(threading.Event):
    """The heartbeat's stop event, recording how long each of its waits for the next renewal was."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[float] = []

    def wait(self, timeout=None):
        self.asked.append(timeout)
        return super().wait(timeout)


def test_a_renewal_that_met_an_outage_is_tried_again_once_the_database_is_back(postgres, monkeypatch):
    """Counted in renewals, not seconds: the outage lasts until a renewal has met it (and one
    retry after it), and the renewal after a failed one waits `RETRY_AFTER_ERROR_S`, not the
    3 s interval, until one succeeds."""
    with session_scope() as s:
        instance = TaskInstance(task_set="t", instance_id="i", repo="r", record={})
        run = Run(kind="eval", status="running", config={})
        s.add_all([instance, run])
        s.flush()
        ep = Episode(run_id=run.id, instance_id=instance.id, group_index=0, sample_index=0, status="running")
        s.add(ep)
        s.flush()
        episode_id = ep.id
    owner = lease.new_owner()
    with session_scope() as s:
        assert lease.claim(s, episode_id, "running", owner)
    claimed = _expiry(episode_id)

    outcomes: list[str] = []  # each renewal the heartbeat tried: "ok" or "error"
    renew = lease.renew

    def spy(*args):
        try:
            held = renew(*args)
        except Exception:
            outcomes.append("error")
            raise
        outcomes.append("ok")
        return held

    monkeypatch.setattr(lease, "renew", spy)
    beat = lease.Heartbeat(episode_id, "running", owner)
    beat._stop = waits = _Waits()
    with beat:
        cut_database(postgres["DATABASE_URL"])
        # the waits only bound a hang: the renewals due meet the outage, however late they come
        wait_for(lambda: outcomes.count("error") >= 2, 60, interval=0.05, what=lambda: f"renewals {outcomes}")
        restore_database(postgres["DATABASE_URL"])
        wait_for(lambda: "ok" in outcomes[outcomes.index("error"):], 60, interval=0.05,
                 what=lambda: f"a renewal after the outage: {outcomes}")
        assert not beat.lost
    first_ok = outcomes.index("ok", outcomes.index("error"))
    # waits[k] comes before renewal k; each one after a failed renewal is the short retry
    after_errors = [waits.asked[k + 1] for k, o in enumerate(outcomes[:first_ok]) if o == "error"]
    assert after_errors and all(w == lease.Heartbeat.RETRY_AFTER_ERROR_S for w in after_errors), (outcomes, waits.asked)
    assert waits.asked[0] == 3.0  # the interval: the retry is not just every wait being short
    assert _expiry(episode_id) > claimed, "the lease was not renewed after the database came back"
