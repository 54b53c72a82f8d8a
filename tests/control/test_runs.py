"""Run start is one restartable step: a start killed or failed halfway is found by the watchdog and
started again; a full var disk (a real 1 MiB tmpfs) fails the start with ENOSPC named and leaves
nothing partial, and the run finishes once space returns; a run folder is set aside only when its
`run.json` names another run."""
from __future__ import annotations

import datetime as dt
import json
import time

import pytest
from sqlalchemy import select

from app import config
from app.control import runs, scheduler, watchdog
from app.db import session_scope
from app.paths import RunPaths
from app.tables import Episode, Run, utcnow
from app.transitions import transition
from support import REDIS_BASE, celery_worker_args, wait_for
from support.faults import full_disk

REDIS_DB = 10
SIMULATED_EVAL = {"kind": "eval", "group_size": 2, "tasks_per_step": 1,
                  "simulate": {"episode_median_s": 0.1}, "scheduling": {"rollout_slots": 2}}


@pytest.fixture
def fast_watchdog(monkeypatch, tmp_path):
    """Run folders in the test's folder; a start counts as stuck 3 s after it began."""
    env = {"TURNSTILE_VAR_DIR": str(tmp_path / "var"), "TURNSTILE_LEASE_TTL_S": "2",
           "TURNSTILE_WATCHDOG_INTERVAL_S": "1", "TURNSTILE_MAX_REDELIVERIES": "5"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config.reset_settings()
    yield env
    config.reset_settings()


def _queued_run(cfg: dict = SIMULATED_EVAL) -> int:
    with session_scope() as s:
        run = Run(kind=cfg["kind"], status="queued", config=cfg)
        s.add(run)
        s.flush()
        return run.id


def _run(run_id: int) -> Run:
    with session_scope() as s:
        return s.get(Run, run_id)


def test_a_start_killed_after_its_first_commit_is_started_again(any_database, redis_db, fast_watchdog):
    """What a kill -9 (or a Redis blip) between `queued → running` and the instance list leaves:
    ticks plan nothing and never raise (an eval run without groups is not finished), and the
    watchdog re-sends the start, which then takes the run's first tick."""
    run_id = _queued_run()
    with session_scope() as s:
        assert transition(s, Run, run_id, "running", started_at=utcnow() - dt.timedelta(seconds=10))
    assert not scheduler.tick(run_id)  # no TypeError on the missing instance list
    assert _run(run_id).status == "running"
    plan = watchdog.watchdog(set(), 0)
    assert plan.start == [run_id] and run_id in plan.tick
    first = runs.start_run(run_id)
    assert len(first.prepare) == 2
    assert _run(run_id).summary["instance_ids"]
    assert watchdog.watchdog(set(), 0).start == []  # started: nothing to re-send
    assert not runs.start_run(run_id).prepare  # a duplicate start changes nothing


def test_a_start_just_begun_is_not_re_sent(any_database, redis_db, fast_watchdog):
    run_id = _queued_run()
    with session_scope() as s:
        transition(s, Run, run_id, "running", started_at=utcnow())
    assert watchdog.watchdog(set(), 0).start == []


def test_a_permanent_start_error_fails_the_run_with_it(any_database, redis_db, fast_watchdog, tmp_path):
    """A var folder that is a file (not a full disk, not a blip) fails the run at once, with the error."""
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "runs").write_text("not a folder")
    run_id = _queued_run()
    assert not runs.start_run(run_id)
    run = _run(run_id)
    assert run.status == "failed" and run.error.startswith("starting the run: ") and "Errno 28" not in run.error, run.error


def test_a_folder_is_set_aside_only_when_its_run_json_names_another_run(database, fast_watchdog):
    settings = config.get_settings()
    mine = RunPaths(5)
    mine.checkpoint(0).mkdir(parents=True)
    mine.identity.write_text("")  # as a full disk left it before writes were atomic
    runs.claim_run_dir(5, "2026-01-01T00:00:00")
    assert mine.checkpoint(0).is_dir(), "the run's own checkpoints were set aside"
    assert json.loads(mine.identity.read_text()) == {"database": settings.database_url,
                                                     "created_at": "2026-01-01T00:00:00"}
    mine.identity.unlink()  # a start killed before it wrote run.json
    runs.claim_run_dir(5, "2026-01-01T00:00:00")
    assert mine.checkpoint(0).is_dir()
    other = RunPaths(6)
    other.checkpoint(0).mkdir(parents=True)
    other.identity.write_text(json.dumps({"database": "sqlite:///elsewhere.db", "created_at": "2025-01-01"}))
    runs.claim_run_dir(6, "2026-01-01T00:00:00")
    assert not other.checkpoint(0).exists()
    assert [p.name.split("-")[0] for p in other.root.parent.glob("6.stale-*")] == ["6.stale"]


def test_folders_of_one_id_set_aside_in_the_same_second_are_all_kept(database, fast_watchdog):
    """Each foreign folder of id 7 is moved aside under its own name, however fast they come:
    a name made of the second alone made the second rename fail (ENOTEMPTY) and the start with it."""
    paths = RunPaths(7)
    for n in range(3):
        paths.checkpoint(n).mkdir(parents=True)
        paths.identity.write_text(json.dumps({"database": f"sqlite:///other-{n}.db", "created_at": "2025-01-01"}))
        runs.claim_run_dir(7, "2026-01-01T00:00:00")
    aside = sorted(paths.root.parent.glob("7.stale-*"))
    assert len(aside) == 3
    assert sorted(next((p / "checkpoints").iterdir()).name for p in aside) == sorted(
        paths.checkpoint(n).name for n in range(3))


@pytest.fixture
def full_var(tmp_path, fast_watchdog):
    """`<tmp>/var` on a real 1 MiB tmpfs, filled to the last byte by `fill` (unmounted at teardown)."""
    var = tmp_path / "var"
    with full_disk(var) as fill:
        yield var, fill


def test_a_full_var_disk_fails_the_start_with_enospc_and_the_run_finishes_once_space_returns(
        any_database, redis_db, full_var, spawn):
    from app.tasks import control as control_tasks
    from app.tasks.send import send_start_run

    var, fill = full_var
    env = {**runs_env(any_database), "TURNSTILE_VAR_DIR": str(var)}
    worker = spawn(celery_worker_args("control,prepare,rollout,grade", concurrency=2), env, name="cpu")
    run_id = _queued_run()
    send_start_run(run_id, 9)

    def start_error():
        return (_run(run_id).summary or {}).get("start_error")

    error = wait_for(start_error, 60, what=f"the start to fail\n{worker.output()[-3000:]}")
    assert "Errno 28" in error and "No space left on device" in error, error
    run = _run(run_id)
    assert run.status == "running" and "instance_ids" not in run.summary
    root = RunPaths(run_id, var).root
    assert not root.exists() or list(root.iterdir()) == [], "a partial file is visible in the run folder"
    assert not scheduler.tick(run_id)
    report = control_tasks.watchdog()  # the beat's pass, in-process: the disk is still full
    assert run_id in report["restarted"]
    fill.unlink()  # space returns
    deadline = time.monotonic() + 90

    def finished():
        if time.monotonic() < deadline:
            control_tasks.watchdog()
        return _run(run_id).status in ("completed", "failed")

    wait_for(finished, 90, interval=1.0, what=f"the run to finish\n{worker.output()[-3000:]}")
    run = _run(run_id)
    assert run.status == "completed", (run.error, worker.output()[-3000:])
    assert "start_error" not in run.summary and run.summary["start_failures"] >= 1
    assert json.loads(RunPaths(run_id, var).identity.read_text())["created_at"] == run.created_at.isoformat()
    with session_scope() as s:
        statuses = s.scalars(select(Episode.status).where(Episode.run_id == run_id)).all()
    assert statuses == ["completed", "completed"]


def runs_env(database_url: str) -> dict:
    """The environment of a worker that shares this test's database, Redis and settings."""
    import os

    keys = ("TURNSTILE_LEASE_TTL_S", "TURNSTILE_WATCHDOG_INTERVAL_S", "TURNSTILE_MAX_REDELIVERIES", "TURNSTILE_VAR_DIR")
    return {"DATABASE_URL": database_url, "REDIS_URL": f"{REDIS_BASE}/10", **{k: os.environ[k] for k in keys}}
