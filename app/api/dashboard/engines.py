"""Who is on which engines now: the runs list's "Engines" table, read from SQL as plain dicts.

One entry per engine address that a live run (queued, running or cancelling, with real stages)
uses: the runs on it, each with what it puts there (a LoRA adapter on the shared base, or the
engines' whole weights), the policy version it serves, its rollouts in flight and its fair share
of the rollout workers (`app.control.shares`), and the harness calls the gateway held while the
engine loaded new weights (`app.weight_gate`).  Two LoRA runs on one engine are two adapters
served side by side; a full fine-tune beside other runs replaces their weights (the API warned
when it was created, `app.control.tenancy`).
"""
from __future__ import annotations

import redis as redis_lib
from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app import weight_gate
from app.config import get_settings
from app.control import shares
from app.control.tenancy import ACTIVE_STATES
from app.proxy.sessions import current_adapter
from app.tables import Episode, Run


def engine_sharing(s: Session) -> list[dict]:
    """`[{"url", "held", "runs": [{"id", "kind", "status", "weights", "adapter", "policy_version", "running",
    "share", "allowance"}]}]`, engines by address, runs by id.  `weights`: "LoRA adapter", "full
    weights" (a train run's full fine-tune, or an eval run that loaded a checkpoint) or "base model";
    `allowance`: rollouts in flight it may have now (None: its own `rollout_slots`, no other run
    wants the rollout workers).  `held`: `weight_gate.hold_stats` of the engine (calls held at its
    weight reloads so far, their held seconds, how many are held now), None when Redis cannot be
    read.  A run whose stored config no longer validates is left out."""
    runs = s.scalars(select(Run).where(Run.status.in_(ACTIVE_STATES)).order_by(Run.id)).all()
    if not runs:
        return []
    ids = [r.id for r in runs]
    running = dict(s.execute(select(Episode.run_id, func.count()).where(Episode.run_id.in_(ids),
                                                                         Episode.status == "running")
                             .group_by(Episode.run_id)).all())
    default_urls = get_settings().engine_urls
    allowed = shares.allowances(s)
    by_url: dict[str, list[dict]] = {}
    for run in runs:
        try:
            cfg = run.run_config()
        except ValidationError:
            continue
        if cfg.simulate is not None:
            continue  # simulated stages call no engine
        if cfg.kind == "train":
            weights = "LoRA adapter" if cfg.training.lora else "full weights"
        else:
            weights = "full weights" if cfg.model.checkpoint else "base model"
        row = {"id": run.id, "kind": run.kind, "status": run.status, "weights": weights,
               "adapter": current_adapter(run.id, run.config), "policy_version": run.policy_version,
               "running": int(running.get(run.id, 0)), "share": cfg.scheduling.share,
               "allowance": allowed.get(run.id)}
        for url in cfg.model.engine_urls or default_urls:
            by_url.setdefault(url, []).append(row)
    return [{"url": url, "held": _held(url), "runs": rows} for url, rows in sorted(by_url.items())]


def _held(url: str) -> dict | None:
    try:
        return weight_gate.hold_stats(url)
    except redis_lib.RedisError:
        return None  # the page still shows who is on the engine
