"""The KEDA scaler's query, run as KEDA runs it (a libpq connection string to a real PostgreSQL)
in the middle of a simulated run driven through the control code: it returns exactly the
episodes whose stage messages wait for a worker (queued) plus those a worker holds (leased),
per worker group, as the run moves from prepare to rollout to grade."""
from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import select

from app.control import episodes, lease, runs
from app.db import session_scope
from app.deploy.scaler import work_query
from app.deploy.spec import load_spec
from app.config import ROOT
from app.tables import Episode, Run
from support.faults import postgres_process_env

REDIS_DB = 10
RUN = {"kind": "eval", "group_size": 4, "tasks_per_step": 1, "simulate": {"episode_median_s": 0.05, "episode_sigma": 0},
       "scheduling": {"rollout_slots": 2, "ready_depth": 4}}


@pytest.fixture
def postgres(pg_url, monkeypatch, tmp_path):
    yield from postgres_process_env(pg_url, monkeypatch, tmp_path, TURNSTILE_LEASE_TTL_S="60")


def _keda(pg_url: str, queues) -> int:
    """The scaler's value: its query over a plain libpq URL, the form the Secret's scaler key holds."""
    with psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        return conn.execute(work_query(queues)).fetchone()[0]


def _queued_and_leased(stage: str) -> tuple[set[int], set[int]]:
    """Independent of the query: episodes in `stage` without and with a lease owner."""
    with session_scope() as s:
        rows = s.scalars(select(Episode).where(Episode.status == stage)).all()
        return {e.id for e in rows if e.lease_owner is None}, {e.id for e in rows if e.lease_owner}


def test_the_scaler_counts_the_work_queued_and_leased(postgres, pg_url, redis_db):
    groups = {name: w.queues for name, w in load_spec(ROOT / "deploy/examples/small.yaml").workers.items()}
    with session_scope() as s:
        run = Run(kind="eval", status="queued", config=RUN)
        s.add(run)
        s.flush()
        run_id = run.id
    assert _keda(pg_url, groups["rollout"]) == 0 and _keda(pg_url, groups["grade"]) == 0

    plan = runs.start_run(run_id)
    sent_prepare = list(plan.prepare)
    assert len(sent_prepare) == 4
    # Four prepare messages sent, none taken yet: four queued.
    assert _queued_and_leased("preparing") == (set(sent_prepare), set())
    assert _keda(pg_url, groups["rollout"]) == 4

    # A worker takes the first one (its lease) and is still preparing it: queued 3 + leased 1.
    with session_scope() as s:
        assert lease.claim(s, sent_prepare[0], "preparing", lease.new_owner())
    assert _queued_and_leased("preparing") == (set(sent_prepare[1:]), {sent_prepare[0]})
    assert _keda(pg_url, groups["rollout"]) == 4

    # The other three are prepared; the run's two slots send two rollouts, the third waits READY
    # on its pod.  The rollout group holds 1 leased prepare + 1 ready + 2 queued rollouts.
    sent_rollout: list[int] = []
    for episode_id in sent_prepare[1:]:
        sent_rollout += episodes.prepare(episode_id).rollout
    assert len(sent_rollout) == 2
    with session_scope() as s:
        ready = set(s.scalars(select(Episode.id).where(Episode.status == "ready")))
    assert len(ready) == 1
    assert _queued_and_leased("running") == (set(sent_rollout), set())
    assert _keda(pg_url, groups["rollout"]) == 1 + 1 + 2
    assert _keda(pg_url, groups["grade"]) == 0

    # One rollout finishes: its grade message is sent (queued for the grade group), its slot goes
    # to the READY runtime, whose rollout message is sent.
    plan = episodes.rollout(sent_rollout[0])
    assert plan.grade == [sent_rollout[0]] and plan.rollout == sorted(ready)
    assert _queued_and_leased("grading") == ({sent_rollout[0]}, set())
    assert _keda(pg_url, groups["grade"]) == 1
    assert _keda(pg_url, groups["rollout"]) == 1 + 2  # leased prepare + two rollouts queued

    # Graded: nothing left for the grade pods, which KEDA may now scale to zero.
    episodes.grade(sent_rollout[0])
    assert _keda(pg_url, groups["grade"]) == 0
    with pytest.raises(ValueError, match="no queued or leased"):
        work_query(groups["control"])
