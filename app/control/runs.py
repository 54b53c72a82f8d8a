"""Run start: choose the run's stages, claim its folder, set up its engines, load its instances.

`stages_for` is the one place that decides between real and simulated stages.
`start_run` is one restartable step (again after a redelivery or the watchdog's re-send: it is
idempotent) and returns the first tick's `Plan`.
"""
from __future__ import annotations

import errno
import json
import logging
import time
import uuid

from sqlalchemy import select

from app.config import get_settings
from app.control import scheduler, redis_state, trainer_shares
from app.control.plan import Plan
from app.control.real_stages import RealStages
from app.control.simulated_stages import SimulatedStages
from app.control.stages import Stages
from app.db import session_scope
from app.paths import RunPaths, write_atomic
from app.redis_client import held_lock
from app.retry import is_transient
from app.tables import Run, utcnow
from app.runconfig import RunConfig
from app.transitions import transition

log = logging.getLogger("turnstile.runs")


def stages_for(cfg: RunConfig) -> Stages:
    """The stage implementation of a run with config `cfg` (the one place that reads `simulate`)."""
    if cfg.simulate is not None:
        return SimulatedStages(cfg.simulate)
    return RealStages()


def check_run_config(cfg: RunConfig) -> tuple[str, str] | None:
    """`(field, message)` of the first choice in `cfg` this installation cannot serve, or None."""
    problems = run_config_problems(cfg)
    return problems[0] if problems else None


def run_config_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """Every `(field, message)` of a choice in `cfg` this installation cannot serve; [] when none.

    Run by the API before a run is created; imports nothing heavy (no torch).
    """
    from app.control.heldout import problems as heldout_problems
    from app.control.preflight import check_routing_replay

    stages = stages_for(cfg)
    replay = check_routing_replay(cfg, uses_engines=getattr(stages, "uses_engines", False))
    return stages.preflight(cfg) + heldout_problems(cfg) + ([replay] if replay else [])


def start_run(run_id: int) -> Plan:
    """Move a queued run to running, claim its folder, set up its engines, load its instances,
    and take the first tick: one restartable step.

    The step is done once per run and may be started again at any point (a redelivery, the
    watchdog's re-send of a `running` run without `summary.instance_ids`): the run's start lock
    lets one start work at a time (a second returns an empty plan), and each part is idempotent.
    A permanent error (a bad task set, an engine that cannot be set up, a folder that cannot be
    made) fails the run with the reason (its `error`).  A transient one (`start_error_is_transient`:
    a full disk, a dropped database or Redis connection) leaves the run `running` without its
    instance list, counted in `summary.start_failures` with `summary.start_error`, for the
    watchdog to start again; past `max_redeliveries` such failures the run fails with it.
    Returns the first tick's plan (empty when the run is not running or not started yet).
    """
    with session_scope() as s:
        won = transition(s, Run, run_id, "running", started_at=utcnow())
        run = s.get(Run, run_id)
        if run is None or run.status != "running":
            return Plan()
        cfg = run.run_config()
        created_at = run.created_at.isoformat()
        has_plan = (run.summary or {}).get("instance_ids") is not None
    if has_plan:
        return scheduler.tick(run_id)  # started already (this message is a duplicate)
    with held_lock(start_lock_key(run_id)) as held:
        if not held:
            return Plan()  # another start of this run is under way
        if won:
            redis_state.forget_run(run_id)  # a first start: no key of an earlier database's run of this id survives
            trainer_shares.forget(run_id)
        try:
            claim_run_dir(run_id, created_at)
            stages = stages_for(cfg)
            stages.setup_engines(run_id, cfg, _runs_sharing_engines(run_id) if stages.uses_engines else [])
            instance_ids = stages.load_instances(cfg)
        except Exception as exc:  # noqa: BLE001 (a failed start is recorded with its reason, never silent)
            _start_failed(run_id, exc)
            return Plan()
        with session_scope() as s:
            run = s.get(Run, run_id)
            summary = {k: v for k, v in (run.summary or {}).items() if k != "start_error"}
            run.summary = {**summary, "instance_ids": instance_ids}
    log.info("run=%s event=start won=%s", run_id, won)
    return scheduler.tick(run_id)


def start_lock_key(run_id: int) -> str:
    """The Redis lock held while run `run_id` is being started (`start_run`)."""
    return f"turnstile:run:{run_id}:start"


# Disk errors that end when space is freed (a full var disk, a user's quota).
TRANSIENT_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def start_error_is_transient(exc: BaseException) -> bool:
    """Whether a start that raised `exc` may succeed if tried again unchanged: a full disk
    (`TRANSIENT_ERRNOS`), or a dropped database or Redis connection (`app.retry.is_transient`)."""
    return is_transient(exc) or (isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS)


def _start_failed(run_id: int, exc: BaseException) -> None:
    """Record a failed start: fail the run, or (a transient error, within `max_redeliveries`)
    count it and leave the run to the watchdog's next re-send."""
    error = f"starting the run: {type(exc).__name__}: {exc}"[:1000]
    with session_scope() as s:
        run = s.get(Run, run_id)
        failures = int((run.summary or {}).get("start_failures", 0)) + 1
        if start_error_is_transient(exc) and failures <= get_settings().max_redeliveries:
            run.summary = {**(run.summary or {}), "start_failures": failures, "start_error": error}
            log.warning("run=%s event=start_failed transient=true failures=%s error=%s", run_id, failures, error)
            return
        transition(s, Run, run_id, "failed", error=error, finished_at=utcnow())
    log.warning("run=%s event=start_failed transient=false error=%s", run_id, error)


def _runs_sharing_engines(run_id: int) -> list[int]:
    """Ids of the other running runs whose stages sample from the deployment's engines."""
    with session_scope() as s:
        return [r.id for r in s.scalars(select(Run).where(Run.status == "running", Run.id != run_id))
                if stages_for(r.run_config()).uses_engines]


def claim_run_dir(run_id: int, created_at: str) -> None:
    """Make `<var_dir>/runs/<id>/` this run's own: move aside a folder left by another database's run `id`.

    Checkpoint resume reads that folder, so a stale one (same id, other database or a wiped
    database) must never be mistaken for this run's progress.  The folder's `run.json`
    records which database and creation time it belongs to; only a `run.json` that names
    another run sets the folder aside.  A folder without a readable `run.json` (a start that
    died before writing it, an empty file left by a full disk before writes were atomic) is
    this run's: its checkpoints are kept and `run.json` is written.  Raises `OSError` when the
    folder or `run.json` cannot be written (ENOSPC on a full disk); `run.json` is written
    atomically (`write_atomic`), so a failed write leaves none.
    """
    settings = get_settings()
    paths = RunPaths(run_id, settings.var_dir)
    root, marker = paths.root, paths.identity
    identity = {"database": settings.database_url, "created_at": created_at}
    if root.exists():
        try:
            found = json.loads(marker.read_text())
        except (OSError, ValueError):
            found = None
        if found == identity:
            return
        if isinstance(found, dict) and found:
            log.warning("run=%s event=run_dir_set_aside owner=%s", run_id, found)
            # A per-second name collided when two set-asides of one id fell in the same second
            # (rename(2) cannot replace a non-empty folder): the suffix is unique.
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
            root.rename(root.with_name(f"{run_id}.stale-{stamp}-{uuid.uuid4().hex[:8]}"))
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(marker, json.dumps(identity))
