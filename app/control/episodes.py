"""An episode's life: prepare → READY buffer → rollout → grade, as plain functions.

The Celery tasks in `app.tasks.episodes` call these and send the `Plan` each returns.
Each stage starts by claiming the episode's stage lease (`app.control.lease`, a
compare-and-set on the row), renews it while it works, and ends with a transition that
requires the lease to be still its own.  So a duplicate message (a redelivery while the
stage runs) finds a live lease and returns, a message for a finished stage finds the
state moved on, and a worker that lost its lease never writes; a stage whose worker died
is re-dispatched by the watchdog once its lease expires (`app.control.reaper`).  A closing write
that meets a dropped database or Redis connection is retried within the lease (`closing_write`),
so finished work is not redone for a blip.  The stage's
work itself is done by the run's `Stages` (`app.control.stages`).

The DB session is closed during the long work of each stage (harness run, test run):
no pooled connection is held for minutes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import secrets

from sqlalchemy import update

from app.control import lease, scheduler, redis_state
from app.control.plan import Plan, celery_priority
from app.control.runs import stages_for
from app.control.stages import STAGE_FAILED, Claim, HarnessOutcome, forfeit_record
from app.config import get_settings
from app.db import session_scope
from app.retry import retry_transient
from app.runtimes.patch import PatchError
from app.tables import SUPERSEDED, Completion, Episode, Run, utcnow
from app.runconfig import RunConfig
from app.transitions import transition

log = logging.getLogger("turnstile.episodes")


def _load(episode_id: int) -> tuple[Episode, RunConfig, dict] | None:
    """The episode, its run's config and its instance record (loaded now: the session closes on return)."""
    with session_scope() as s:
        ep = s.get(Episode, episode_id)
        if ep is None:
            return None
        return ep, s.get(Run, ep.run_id).run_config(), dict(ep.instance.record)


def fail(episode_id: int, error: str, owner: str | None = None) -> Plan:
    """Mark the episode failed with `error` (if it is not finished yet), release its runtime, tick its run.

    `owner`: the failing stage's lease owner; when given, nothing happens unless that owner
    still holds the episode's lease (a stage that lost its lease does not fail its successor).
    """
    def write() -> int | None:
        with session_scope() as s:
            ep = s.get(Episode, episode_id)
            if ep is None or (owner is not None and ep.lease_owner != owner):
                return None
            # the session ends with the episode: the gateway refuses its key from now on
            transition(s, Episode, episode_id, "failed", where={"lease_owner": owner} if owner else None,
                       error=error[:4000], finished_at=utcnow(), session_token_hash=None)
            return ep.run_id

    run_id = closing_write(write, f"episode {episode_id} failed")
    if run_id is None:
        return Plan()
    log.warning("episode=%s event=failed error=%s", episode_id, error[:200])
    _release_runtime_of(episode_id)
    return scheduler.tick(run_id)


def closing_write(write, what: str):
    """`write()` (one transaction, or an idempotent Redis command), retried through a database or
    Redis blip for up to one lease period (`app.retry.retry_transient`): a stage whose work is
    done keeps it.  The write's own `lease_owner` condition still fences it: once another worker
    took the lease over, it changes nothing.  Raises the last transient error past the lease."""
    return retry_transient(write, deadline_s=get_settings().lease_ttl_s, what=what)


def _release_runtime_of(episode_id: int) -> None:
    with session_scope() as s:
        ep = s.get(Episode, episode_id)
        if ep is None or not ep.runtime:
            return
        runtime, cfg = ep.runtime, s.get(Run, ep.run_id).run_config()
    stages_for(cfg).release(runtime)


# --- prepare ------------------------------------------------------------------------


def placed_here(runtime: dict) -> dict:
    """`runtime` stamped with this machine's name (`TURNSTILE_HOST_NAME`): the runtime is on this
    machine's disk, so its rollout is routed to this host's own queue (`app.celery`)."""
    return {**runtime, "host": get_settings().host_name}


def prepare(episode_id: int) -> Plan:
    """Build the episode's runtime and put it in the run's READY buffer."""
    loaded = _load(episode_id)
    if loaded is None:
        return Plan()
    ep, cfg, record = loaded
    if ep.status != "preparing":
        return Plan()  # already prepared, running, done or cancelled
    owner = lease.new_owner()
    with session_scope() as s:
        if not lease.claim(s, episode_id, "preparing", owner):
            return Plan()  # another worker holds the stage (a duplicate message), or it moved on
    stages = stages_for(cfg)
    try:
        with lease.Heartbeat(episode_id, "preparing", owner):
            runtime = stages.prepare(record, episode_id, cfg)
    except Exception as exc:  # noqa: BLE001 (any prepare error fails the episode with its reason)
        return fail(episode_id, f"{STAGE_FAILED['prepare']}{type(exc).__name__}: {exc}", owner)
    runtime = placed_here(runtime)

    def write() -> bool:
        with session_scope() as s:
            return transition(s, Episode, episode_id, "ready", expect=("preparing",), where={"lease_owner": owner},
                              runtime=runtime, prepared_at=utcnow(), **lease.clear_values())

    def landed() -> bool:  # a commit whose reply was lost with the connection, then retried
        with session_scope() as s:
            row = s.get(Episode, episode_id)
            return row is not None and row.status == "ready" and row.runtime == runtime

    if not closing_write(write, f"episode {episode_id} prepared") and not closing_write(landed, "prepare landed"):
        stages.release(runtime)
        return Plan()
    closing_write(lambda: redis_state.push_ready(ep.run_id, episode_id), f"episode {episode_id} READY")
    return scheduler.tick(ep.run_id)


# --- rollout ------------------------------------------------------------------------


def _claim_rollout(episode_id: int, owner: str) -> tuple[Claim, str] | None:
    """Take the episode's rollout lease and its next attempt; returns the claim and the session
    token (plaintext), or None when another worker holds the rollout or it moved on."""
    with session_scope() as s:
        ep = s.get(Episode, episode_id)
        if ep is None or ep.status != "running":
            return None
        run = s.get(Run, ep.run_id)
        attempt = ep.attempts + 1
        token = secrets.token_urlsafe(32)
        if not lease.claim(
            s, episode_id, "running", owner, where={"attempts": ep.attempts},
            attempts=attempt, started_at=utcnow(), policy_version=run.policy_version,
            session_token_hash=hashlib.sha256(token.encode()).hexdigest(),
        ):
            return None
        if attempt > 1:
            # Completions of a dead attempt stay for inspection but are never trained on.
            s.execute(
                update(Completion)
                .where(Completion.episode_id == episode_id, Completion.rejected_reason.is_(None))
                .values(rejected_reason=f"{SUPERSEDED}: attempt {attempt - 1} was lost with its worker")
            )
        claim = Claim(episode_id, ep.run_id, attempt, run.run_config(), ep.instance.record, ep.runtime,
                      run.policy_version)
    return claim, token


def rollout(episode_id: int) -> Plan:
    """Run the episode's agent under its budget, then hand over to grading.

    An attempt without a usable model call (`HarnessOutcome.failure`) fails the episode
    instead (`_harness_failed`); it is never graded.
    """
    owner = lease.new_owner()
    claimed = _claim_rollout(episode_id, owner)
    if claimed is None:
        return Plan()
    claim, token = claimed
    redis_state.record_ready_wait(claim.run_id, episode_id)
    log.info("episode=%s event=rollout attempt=%s", episode_id, claim.attempt)
    try:
        with lease.Heartbeat(episode_id, "running", owner) as beat:
            if claim.attempt > 1 and claim.runtime is not None:
                claim = _fresh_runtime(claim, owner)
            outcome = stages_for(claim.cfg).rollout(
                claim, token, cancelled=lambda: beat.lost or redis_state.cancel_polled(episode_id))
    except Exception as exc:  # noqa: BLE001 (any rollout error fails the episode with its reason)
        redis_state.free_slot(claim.run_id)
        return fail(episode_id, f"{STAGE_FAILED['rollout']}{type(exc).__name__}: {exc}", owner)
    if not closing_write(lambda: lease.holds(episode_id, owner), f"episode {episode_id} rollout lease"):
        return Plan()  # taken over (this worker stalled past its lease): the runtime is the successor's now
    if closing_write(lambda: redis_state.is_cancelled(episode_id), f"episode {episode_id} cancel flag"):
        _release_runtime_of(episode_id)
        redis_state.free_slot(claim.run_id)
        return scheduler.tick(claim.run_id)
    if outcome.failure is not None:
        return _harness_failed(claim, outcome, owner)
    def write() -> bool:
        with session_scope() as s:
            return transition(
                s, Episode, episode_id, "grading", expect=("running",),
                where={"attempts": claim.attempt, "lease_owner": owner},
                patch=outcome.patch, exit_status=outcome.exit_status, timed_out=outcome.timed_out,
                rollout_finished_at=utcnow(), **lease.dispatch_values(),
                # an episode its own actions ended is scored 0 by the grade stage, not graded
                grading_report={"forfeit": outcome.forfeit} if outcome.forfeit else None,
                session_token_hash=None,  # the session ends with the rollout: the gateway now refuses the key
            )

    won = closing_write(write, f"episode {episode_id} rolled out")
    _release_runtime_of(episode_id)
    closing_write(lambda: redis_state.free_slot(claim.run_id), f"run {claim.run_id} slot freed")
    plan = Plan(grade=[episode_id] if won else [], priority=celery_priority(claim.cfg.priority))
    plan += scheduler.tick(claim.run_id)  # a rollout slot is free
    return plan


def _fresh_runtime(claim: Claim, owner: str) -> Claim:
    """A new attempt of a lost rollout starts from a freshly prepared runtime: the lost attempt's
    agent may have edited the workspace (its patch would leak into this attempt's).  The old
    runtime is released, a new one prepared and stored on the episode (while `owner` holds the
    lease); returns the claim with the new runtime.  Raises what the stage's `prepare` raises.
    """
    stages = stages_for(claim.cfg)
    stages.release(claim.runtime)
    runtime = placed_here(stages.prepare(claim.record, claim.episode_id, claim.cfg))
    with session_scope() as s:
        kept = s.execute(update(Episode).where(Episode.id == claim.episode_id, Episode.lease_owner == owner)
                         .values(runtime=runtime).execution_options(synchronize_session=False)).rowcount
    if not kept:
        stages.release(runtime)
        raise RuntimeError("the rollout's lease was lost while its runtime was prepared again")
    log.info("episode=%s event=runtime_prepared_again attempt=%s", claim.episode_id, claim.attempt)
    return dataclasses.replace(claim, runtime=runtime)


def _harness_failed(claim: Claim, outcome: HarnessOutcome, owner: str) -> Plan:
    """Fail an episode whose harness made no usable model call (never graded, never trained).

    Rule: a reward is a judgement of what the policy sampled; when the policy sampled
    nothing (the CLI crashed, overflowed the context on its first call, or ran out of time
    before a call was answered) a reward of 0 would train the group on a harness fault.
    The patch, exit status and timeout flag stay on the row for inspection; the session
    ends (the gateway now refuses the key); the runtime and the rollout slot are released.
    """
    episode_id = claim.episode_id
    def write() -> bool:
        with session_scope() as s:
            return transition(
                s, Episode, episode_id, "failed", expect=("running",),
                where={"attempts": claim.attempt, "lease_owner": owner},
                patch=outcome.patch, exit_status=outcome.exit_status, timed_out=outcome.timed_out,
                error=(outcome.failure or "")[:4000], rollout_finished_at=utcnow(), finished_at=utcnow(),
                session_token_hash=None,
            )

    won = closing_write(write, f"episode {episode_id} harness failed")
    if won:
        log.warning("episode=%s event=harness_failed error=%s", episode_id, (outcome.failure or "").split("\n", 1)[0])
    _release_runtime_of(episode_id)
    redis_state.free_slot(claim.run_id)
    return scheduler.tick(claim.run_id)


# --- grade --------------------------------------------------------------------------


def grade(episode_id: int) -> Plan:
    """Grade the episode's patch with the instance's own tests; record the reward.

    An episode that the agent's own actions ended after the policy sampled (its rollout's
    `forfeit`), or whose patch the grader cannot extract from the applied tree (files of the
    patch that break git: `PatchError`), is scored 0 ungraded (`Stages.forfeit`) and trains in its
    group; `grading_report["forfeit"]` says why.  Any other grading error fails the episode.
    """
    loaded = _load(episode_id)
    if loaded is None:
        return Plan()
    ep, cfg, record = loaded
    if ep.status != "grading":
        return Plan()
    owner = lease.new_owner()
    with session_scope() as s:
        if not lease.claim(s, episode_id, "grading", owner):
            return Plan()  # another worker grades it (a duplicate message), or it moved on
    stages = stages_for(cfg)
    forfeit = (ep.grading_report or {}).get("forfeit")
    try:
        with lease.Heartbeat(episode_id, "grading", owner):
            try:
                outcome = (stages.forfeit(record, episode_id, cfg, forfeit) if forfeit else
                           stages.grade(record, ep.patch or "", episode_id, cfg))
            except PatchError as exc:  # the applied patch's own files break extraction in the grader
                forfeit = forfeit_record("patch_extraction", f"grading could not extract the applied patch: {exc}")
                outcome = stages.forfeit(record, episode_id, cfg, forfeit)
    except Exception as exc:  # noqa: BLE001 (any grading error fails the episode with its reason)
        return fail(episode_id, f"{STAGE_FAILED['grading']}{type(exc).__name__}: {exc}", owner)
    def write() -> bool:
        with session_scope() as s:
            return transition(s, Episode, episode_id, "completed", expect=("grading",), where={"lease_owner": owner},
                              reward=outcome.reward, resolved=outcome.resolved, grading_report=outcome.report,
                              merge_stats=outcome.merge_stats, finished_at=utcnow(), **lease.clear_values())

    closing_write(write, f"episode {episode_id} graded")
    if forfeit:
        log.warning("episode=%s event=forfeit reward=0 cause=%s reason=%s", episode_id, forfeit["cause"],
                    forfeit["reason"][:200])
    log.info("episode=%s event=graded reward=%s", episode_id, outcome.reward)
    return scheduler.tick(ep.run_id)
