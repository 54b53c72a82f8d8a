"""A stage's lease renewal through a real PostgreSQL outage: the renewal that met it is tried again
as soon as the database is back, not one renewal interval later (a lease lost to a blip hands
finished work to the reaper)."""
from __future__ import annotations

import time

import pytest

from app.control import lease
from app.db import session_scope
from app.tables import Episode, Run, TaskInstance, aware_utc
from support.faults import cut_database, postgres_process_env, restore_database


@pytest.fixture
def postgres(pg_url, monkeypatch, tmp_path):
    """A fresh PostgreSQL database; leases of 9 s renewed every 3 s."""
    yield from postgres_process_env(pg_url, monkeypatch, tmp_path, TURNSTILE_LEASE_TTL_S="9",
                                    TURNSTILE_LEASE_RENEW_S="3")


def _expiry(episode_id: int):
    with session_scope() as s:
        return aware_utc(s.get(Episode, episode_id).lease_expires_at)


def test_a_renewal_that_met_an_outage_is_tried_again_once_the_database_is_back(postgres):
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
    start = time.monotonic()
    with lease.Heartbeat(episode_id, "running", owner) as beat:
        time.sleep(0.5)
        cut_database(postgres["DATABASE_URL"])
        time.sleep(3.0)  # the renewal due 3 s after the claim meets the outage
        restore_database(postgres["DATABASE_URL"])
        # One interval after the failed renewal (6 s after the claim) is when a heartbeat that
        # only waits for its next renewal would try again; this one is back well before.
        time.sleep(max(0.0, 5.2 - (time.monotonic() - start)))
        renewed = _expiry(episode_id)
        assert not beat.lost
    assert renewed > claimed, "the lease was not renewed after the database came back"
