"""An episode's life: prepare → READY buffer → rollout → grade, as plain functions.

The Celery tasks in app/tasks/episodes.py only call these.  Each stage starts
with a compare-and-set claim on the episode row and ends with another, so a
redelivered message (acks_late after a worker died) either resumes the stage
or finds it done and returns; an attempt that lost its claim never writes.

The DB session is closed during the long work of each stage (harness run,
test run): no pooled connection is held for minutes.
"""
from __future__ import annotations

import hashlib
import logging
import math
import random
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import update

from app import scheduler
from app.config import get_settings
from app.db import session_scope
from app.models import Completion, Episode, Run, utcnow
from app.runconfig import RunConfig
from app.states import transition

log = logging.getLogger("turnstile.episodes")


@dataclass
class Claim:
    """What a stage needs after its claim: the episode, its run config and instance record."""

    episode_id: int
    run_id: int
    attempt: int
    cfg: RunConfig
    record: dict
    runtime: dict | None
    patch: str | None
    policy_version: int


def _load(episode_id: int) -> tuple[Episode, Run, dict] | None:
    """The episode, its run and its instance record (loaded now: the session closes on return)."""
    with session_scope() as s:
        ep = s.get(Episode, episode_id)
        if ep is None:
            return None
        return ep, s.get(Run, ep.run_id), dict(ep.instance.record)


def _fail(episode_id: int, run_id: int, error: str) -> None:
    with session_scope() as s:
        transition(s, Episode, episode_id, "failed", error=error[:4000], finished_at=utcnow())
    log.warning("episode=%s event=failed error=%s", episode_id, error[:200])
    _release_runtime_of(episode_id)
    scheduler.tick(run_id)


def _release_runtime_of(episode_id: int) -> None:
    with session_scope() as s:
        ep = s.get(Episode, episode_id)
        runtime = ep.runtime if ep is not None else None
    if runtime and not runtime.get("simulated"):
        from app.pipeline import release_runtime

        release_runtime(runtime)


def _record_ready_wait(run_id: int, episode_id: int) -> None:
    """READY wait: from the moment this episode's slot was freed to the rollout's start (seconds)."""
    r = scheduler.redis_client()
    freed = r.hget(scheduler.slot_wait_key(run_id), episode_id)
    if freed is not None:
        r.hdel(scheduler.slot_wait_key(run_id), episode_id)
        r.rpush(scheduler.ready_waits_key(run_id), max(0.0, time.time() - float(freed)))


def _free_slot(run_id: int) -> None:
    scheduler.redis_client().rpush(scheduler.slot_free_key(run_id), time.time())


def is_cancelled(episode_id: int) -> bool:
    """True once the scheduler cancelled the episode (straggler cut or run cancel)."""
    return bool(scheduler.redis_client().exists(scheduler.cancel_key(episode_id)))


# --- prepare ------------------------------------------------------------------------


def prepare(episode_id: int) -> None:
    """Build the episode's runtime and put it in the run's READY buffer."""
    loaded = _load(episode_id)
    if loaded is None:
        return
    ep, run, record = loaded
    if ep.status != "preparing":
        return  # already prepared, running, done or cancelled
    cfg = RunConfig.model_validate(run.config)
    try:
        if cfg.simulate is not None:
            time.sleep(cfg.simulate.prepare_s)
            runtime = {"simulated": True}
        else:
            from app.pipeline import prepare_runtime

            runtime = prepare_runtime(record, episode_id, cfg)
    except Exception as exc:
        _fail(episode_id, ep.run_id, f"prepare failed: {type(exc).__name__}: {exc}")
        return
    with session_scope() as s:
        won = transition(s, Episode, episode_id, "ready", expect=("preparing",), runtime=runtime, prepared_at=utcnow())
    if not won:
        if not runtime.get("simulated"):
            from app.pipeline import release_runtime

            release_runtime(runtime)
        return
    scheduler.redis_client().lpush(scheduler.ready_key(ep.run_id), episode_id)
    scheduler.tick(ep.run_id)


# --- rollout ------------------------------------------------------------------------


def _claim_rollout(episode_id: int) -> tuple[Claim, str] | None:
    """Take the episode's next attempt; returns the claim and the session token (plaintext)."""
    settings = get_settings()
    with session_scope() as s:
        ep = s.get(Episode, episode_id)
        if ep is None or ep.status != "running":
            return None
        run = s.get(Run, ep.run_id)
        attempt = ep.attempts + 1
        if attempt > settings.max_redeliveries:
            transition(s, Episode, episode_id, "failed", finished_at=utcnow(),
                       error=f"gave up after {ep.attempts} attempts (worker lost each time)")
            return None
        token = secrets.token_urlsafe(32)
        if not transition(
            s, Episode, episode_id, "running", expect=("running",), where={"attempts": ep.attempts},
            attempts=attempt, started_at=utcnow(), policy_version=run.policy_version,
            session_token_hash=hashlib.sha256(token.encode()).hexdigest(),
        ):
            return None
        if attempt > 1:
            # Completions of a dead attempt stay for inspection but are never trained on.
            s.execute(
                update(Completion)
                .where(Completion.episode_id == episode_id, Completion.rejected_reason.is_(None))
                .values(rejected_reason=f"superseded: attempt {attempt - 1} was lost with its worker")
            )
        claim = Claim(episode_id, ep.run_id, attempt, RunConfig.model_validate(run.config),
                      ep.instance.record, ep.runtime, None, run.policy_version)
    return claim, token


def rollout(episode_id: int) -> None:
    """Run the harness (or the simulated episode) under its budget, then hand over to grading."""
    claimed = _claim_rollout(episode_id)
    if claimed is None:
        return
    claim, token = claimed
    _record_ready_wait(claim.run_id, episode_id)
    log.info("episode=%s event=rollout attempt=%s", episode_id, claim.attempt)
    patch, exit_status, timed_out = "", "submitted", False
    try:
        if claim.cfg.simulate is not None:
            exit_status, timed_out = _simulated_rollout(claim)
        else:
            from app.pipeline import run_harness

            result = run_harness(claim, token, cancelled=lambda: is_cancelled(episode_id))
            patch, exit_status, timed_out = result.patch, result.exit_status, result.timed_out
    except Exception as exc:
        _free_slot(claim.run_id)
        _fail(episode_id, claim.run_id, f"rollout failed: {type(exc).__name__}: {exc}")
        return
    if is_cancelled(episode_id):
        _release_runtime_of(episode_id)
        _free_slot(claim.run_id)
        scheduler.tick(claim.run_id)
        return
    with session_scope() as s:
        won = transition(
            s, Episode, episode_id, "grading", expect=("running",), where={"attempts": claim.attempt},
            patch=patch, exit_status=exit_status, timed_out=timed_out, rollout_finished_at=utcnow(),
            session_token_hash=None,  # the session ends with the rollout: the gateway now refuses the key
        )
    _release_runtime_of(episode_id)
    if won:
        from app.tasks.episodes import grade_episode

        grade_episode.apply_async(args=[episode_id], priority=scheduler.celery_priority(claim.cfg.priority))
    _free_slot(claim.run_id)
    scheduler.tick(claim.run_id)  # a rollout slot is free


def simulated_duration(sim, episode_id: int) -> float:
    """Lognormal episode length in seconds: median `sim.episode_median_s`, log-sigma `sim.episode_sigma`."""
    rng = random.Random(f"{sim.seed}:{episode_id}")
    if sim.episode_sigma == 0:
        duration = sim.episode_median_s
    else:
        duration = rng.lognormvariate(math.log(max(sim.episode_median_s, 1e-6)), sim.episode_sigma)
    return min(duration, sim.max_episode_s) if sim.max_episode_s is not None else duration


def _simulated_rollout(claim: Claim) -> tuple[str, bool]:
    sim = claim.cfg.simulate
    duration = simulated_duration(sim, claim.episode_id)
    budget = claim.cfg.timeouts.agent_s
    deadline = time.monotonic() + min(duration, budget)
    while time.monotonic() < deadline:
        if is_cancelled(claim.episode_id):
            return "cancelled", False
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    return ("timeout", True) if duration > budget else ("submitted", False)


# --- grade --------------------------------------------------------------------------


def grade(episode_id: int) -> None:
    """Grade the episode's patch with the instance's own tests; record the reward."""
    loaded = _load(episode_id)
    if loaded is None:
        return
    ep, run, record = loaded
    if ep.status != "grading":
        return
    cfg = RunConfig.model_validate(run.config)
    try:
        if cfg.simulate is not None:
            rng = random.Random(f"reward:{cfg.simulate.seed}:{episode_id}")
            resolved = rng.random() < cfg.simulate.reward_p
            reward, report, merge_stats = float(resolved), {"simulated": True}, None
        else:
            from app.pipeline import grade_and_build

            resolved, reward, report, merge_stats = grade_and_build(record, ep.patch or "", episode_id, cfg)
    except Exception as exc:
        _fail(episode_id, ep.run_id, f"grading failed: {type(exc).__name__}: {exc}")
        return
    with session_scope() as s:
        transition(s, Episode, episode_id, "completed", expect=("grading",), reward=reward, resolved=resolved,
                   grading_report=report, merge_stats=merge_stats, finished_at=utcnow())
    log.info("episode=%s event=graded reward=%s", episode_id, reward)
    scheduler.tick(ep.run_id)
