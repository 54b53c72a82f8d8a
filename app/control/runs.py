"""Run start: choose the run's stages, claim its folder, set up its engines, load its instances.

`stages_for` is the one place that decides between real and simulated stages.
`start_run` is called once per run (again after a redelivery: it is idempotent) and
returns the first tick's `Plan`.
"""
from __future__ import annotations

import json
import logging
import time

from sqlalchemy import select

from app.config import get_settings
from app.control import scheduler, redis_state
from app.control.plan import Plan
from app.control.real_stages import RealStages
from app.control.simulated_stages import SimulatedStages
from app.control.stages import Stages
from app.db import session_scope
from app.paths import RunPaths
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
    """`(field, message)` of the first choice in `cfg` this installation cannot serve, or None.

    Run by the API before a run is created; imports nothing heavy (no torch).
    """
    return stages_for(cfg).preflight(cfg)


def start_run(run_id: int) -> Plan:
    """Move a queued run to running, load its task instances, and take the first tick.

    A run whose engines or task set cannot be set up is failed with the reason (its
    `error`), never left running.  Returns the first tick's plan (empty when the run is
    not running).
    """
    with session_scope() as s:
        won = transition(s, Run, run_id, "running", started_at=utcnow())
        run = s.get(Run, run_id)
        if run is None or run.status != "running":
            return Plan()
        cfg = run.run_config()
        created_at = run.created_at.isoformat()
        has_plan = bool((run.summary or {}).get("instance_ids"))
    if won:
        redis_state.forget_run(run_id)  # a first start: no key of an earlier database's run of this id survives
    claim_run_dir(run_id, created_at)
    if not has_plan:
        stages = stages_for(cfg)
        try:
            stages.setup_engines(run_id, cfg, _runs_sharing_engines(run_id) if stages.uses_engines else [])
            instance_ids = stages.load_instances(cfg)
        except Exception as exc:  # noqa: BLE001 (a bad task set or engine fails the run with the reason, not silently)
            with session_scope() as s:
                transition(s, Run, run_id, "failed", error=f"starting the run: {exc}"[:1000], finished_at=utcnow())
            return Plan()
        with session_scope() as s:
            run = s.get(Run, run_id)
            run.summary = {**(run.summary or {}), "instance_ids": instance_ids}
    log.info("run=%s event=start won=%s", run_id, won)
    return scheduler.tick(run_id)


def _runs_sharing_engines(run_id: int) -> list[int]:
    """Ids of the other running runs whose stages sample from the deployment's engines."""
    with session_scope() as s:
        return [r.id for r in s.scalars(select(Run).where(Run.status == "running", Run.id != run_id))
                if stages_for(r.run_config()).uses_engines]


def claim_run_dir(run_id: int, created_at: str) -> None:
    """Make `<var_dir>/runs/<id>/` this run's own: move aside a folder left by another database's run `id`.

    Checkpoint resume reads that folder, so a stale one (same id, other database or a wiped
    database) must never be mistaken for this run's progress.  The folder's `run.json`
    records which database and creation time it belongs to.
    """
    settings = get_settings()
    paths = RunPaths(run_id, settings.var_dir)
    root, marker = paths.root, paths.identity
    identity = {"database": settings.database_url, "created_at": created_at}
    if root.exists():
        try:
            mine = json.loads(marker.read_text()) == identity
        except (OSError, ValueError):
            mine = False
        if mine:
            return
        root.rename(root.with_name(f"{run_id}.stale-{int(time.time())}"))
    root.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(identity))
