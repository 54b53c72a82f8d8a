"""The control loop: what to prepare, run, judge and train next for one run.

Every state change (run started, runtime prepared, episode graded, step trained,
cancel requested) calls `tick(run_id)`.  A tick reads the run's state from SQL,
decides, commits, and returns a `Plan` of the messages to send (the task layer sends
them); it never waits for work.  Ticks of one run are serialised by the run's Redis
lock; a tick that finds the lock taken marks the run dirty so the holder runs one more
pass (no event is lost).

Scheduling rules:

* Groups: a train run keeps `tasks_per_step * (1 + async_level)` groups open, where
  async_level is `scheduling.max_async_level` in `async` mode and 0 in `sync` mode
  (sync also waits for the step in training before opening the next groups).
* Rollout slots: `rollout_slots` per run, or its weighted fair share of the deployment's
  rollout workers (`scheduling.share`, `app.control.shares`) while other runs want them too.
* READY buffer: episodes are prepared ahead up to `ready_depth` beyond the free
  rollout slots; prepared episode ids wait in a Redis list per run, so a slot
  that frees is refilled by the next tick without waiting for setup.
* Judging a complete group: fewer than `min_accept_fraction` usable episodes →
  rejected; started more than `max_staleness` versions before the current policy →
  dropped (or down-weighted).  Accepted groups train in completion order.
* Dynamic sampling (`scheduling.dynamic_sampling`, DAPO §3.2): an accepted group whose usable
  rewards are all equal is `filtered` for the next step instead of trained, and the open-group
  count drops, so another group is drawn; after `max_filtered_groups` in one step, uniform
  groups are trained again, after the groups with signal.
* Stragglers: with `cancel_stragglers`, a group with `min_usable` graded episodes
  has its unfinished episodes cancelled, freeing their slots at once.
"""
from __future__ import annotations

import logging
import math

from sqlalchemy import func, select, update

from app.control import heldout, lease, redis_state, shares
from app.control.plan import Plan, celery_priority
from app.control.summary import scheduling_metrics, summarize_run
from app.control.tracking import log_run_summary
from app.db import session_scope
from app.tables import Completion, Episode, Group, Run, TrainingStep, utcnow
from app.runconfig import RunConfig
from app.transitions import TERMINAL, transition

log = logging.getLogger("turnstile.scheduler")


def tick(run_id: int) -> Plan:
    """Advance run `run_id` as far as its current state allows (idempotent); return what to send.

    Every caller first marks the run dirty, then tries the lock; the holder keeps making
    passes while the mark is set, and looks once more after releasing the lock.  So a
    state change that arrives while another process holds the lock is always seen by some
    pass (no lost wake-up).  Raises `redis.RedisError` when Redis cannot be reached.
    """
    plan = Plan()
    redis_state.mark_dirty(run_id)
    while True:
        with redis_state.run_lock(run_id) as held:
            if not held:
                return plan  # the holder will see the mark
            while redis_state.take_dirty(run_id):
                plan += _tick_locked(run_id)
        if not redis_state.is_dirty(run_id):
            return plan


def _tick_locked(run_id: int) -> Plan:
    """One pass, committed before it returns (the plan is sent after the commit)."""
    with session_scope() as s:
        run = s.get(Run, run_id)
        if run is None:
            return Plan()
        if run.status == "cancelling":
            _cancel_all(s, run)
            return Plan()
        if run.status != "running":
            return Plan()
        if (run.summary or {}).get("instance_ids") is None:
            # Not started yet (its start is under way, or failed halfway and is re-sent by the
            # watchdog, `app.control.runs.start_run`): nothing to plan, and an eval run without
            # groups must not look finished.
            return Plan()
        cfg = run.run_config()
        if _too_many_failures(s, run, cfg):
            return Plan()
        _close_complete_groups(s, run, cfg)
        if cfg.kind == "train":
            _plan_train(s, run, cfg)
        else:
            _plan_eval(s, run, cfg)
        to_prepare, to_run = _dispatch(s, run, cfg)
        step_to_train = _maybe_create_step(s, run, cfg) if cfg.kind == "train" else None
        finished = _maybe_finish(s, run, cfg)
        # held-out evals: made by a train run as its policy reaches each `eval_every` point (runs of their own)
        evals = heldout.plan_evals(s, run, cfg, finished) if cfg.kind == "train" else []
        if finished and cfg.eval_of is not None:
            heldout.record_result(s, run, cfg)
        plan = Plan(prepare=to_prepare, rollout=to_run, priority=celery_priority(run.priority),
                    train=[(run_id, step_to_train)] if step_to_train is not None else [], start=evals)
    if finished:
        log.info("run=%s event=finished", run_id)
    return plan


def _too_many_failures(s, run: Run, cfg: RunConfig) -> bool:
    """Fail the run (with the latest episode error) instead of retrying a broken setup forever.

    A harness that has made no usable model call in a group's worth of episodes, with none
    completed, stops the run at once with its cause (`summary.harness_never_worked`).
    """
    from app.control.summary import harness_never_worked

    never = harness_never_worked(s, run.id, cfg.harness, cfg.group_size)
    limit = cfg.scheduling.max_failed_episodes or 2 * cfg.group_size * cfg.tasks_per_step
    failed = s.scalar(select(func.count()).where(Episode.run_id == run.id, Episode.status == "failed"))
    if failed < limit and never is None:
        return False
    last = s.scalar(select(Episode.error).where(Episode.run_id == run.id, Episode.status == "failed")
                    .order_by(Episode.finished_at.desc()).limit(1))
    _cancel_unfinished(s, run.id, "run failed: " + ("no usable model call" if never else "too many failed episodes"))
    run.summary = {**(run.summary or {}), **summarize_run(s, run.id)}
    transition(s, Run, run.id, "failed", finished_at=utcnow(),
               error=never or f"{failed} episodes failed (limit {limit}); last error: {last}")
    return True
def _new_group(s, run: Run, instance_ids: list[int], group_index: int, group_size: int, step: int) -> None:
    instance_id = instance_ids[group_index % len(instance_ids)]
    s.add(Group(run_id=run.id, group_index=group_index, instance_id=instance_id, policy_version=run.policy_version))
    episodes = [Episode(run_id=run.id, instance_id=instance_id, step=step, group_index=group_index, sample_index=k)
                for k in range(group_size)]
    s.add_all(episodes)
    s.flush()
    redis_state.forget_episodes([e.id for e in episodes])


def _group_counts(s, run_id: int) -> dict[str, int]:
    rows = s.execute(select(Group.status, func.count()).where(Group.run_id == run_id).group_by(Group.status)).all()
    return dict(rows)


def _steps(s, run_id: int) -> list[TrainingStep]:
    return list(s.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id).order_by(TrainingStep.step)))


def _plan_train(s, run: Run, cfg: RunConfig) -> None:
    steps = _steps(s, run.id)
    in_training = any(st.status in ("pending", "training") for st in steps)
    remaining = cfg.steps - len(steps)
    if remaining <= 0:
        return
    async_level = cfg.scheduling.max_async_level if cfg.mode == "async" else 0
    if cfg.mode == "sync" and in_training:
        return  # a synchronous step waits for the new policy before opening groups
    counts = _group_counts(s, run.id)
    live = counts.get("open", 0) + counts.get("complete", 0) + counts.get("accepted", 0)
    target = min(cfg.tasks_per_step * (1 + async_level), remaining * cfg.tasks_per_step)
    next_index = s.scalar(select(func.coalesce(func.max(Group.group_index), -1)).where(Group.run_id == run.id)) + 1
    instance_ids = run.summary["instance_ids"]
    for i in range(max(0, target - live)):
        _new_group(s, run, instance_ids, next_index + i, cfg.group_size, step=len(steps) + (live + i) // cfg.tasks_per_step)


def _plan_eval(s, run: Run, cfg: RunConfig) -> None:
    if s.scalar(select(func.count()).select_from(Group).where(Group.run_id == run.id)):
        return
    instance_ids = run.summary["instance_ids"]
    for g in range(len(instance_ids)):
        _new_group(s, run, instance_ids, g, cfg.group_size, step=0)


def _dispatch(s, run: Run, cfg: RunConfig) -> tuple[list[int], list[int]]:
    """Start rollouts for free slots from the READY buffer, and prepare ahead to refill it.  The
    slots are the run's `rollout_slots`, or fewer while other runs want the rollout workers too
    (its fair share: `app.control.shares`)."""
    sched = cfg.scheduling
    share = shares.allowance(s, run.id)
    slots = sched.rollout_slots if share is None else min(sched.rollout_slots, share)
    running = s.scalar(select(func.count()).where(Episode.run_id == run.id, Episode.status == "running"))
    to_run: list[int] = []
    while running + len(to_run) < slots:
        episode_id = redis_state.pop_ready(run.id)
        if episode_id is None:
            break
        if transition(s, Episode, episode_id, "running", expect=("ready",), **lease.dispatch_values()):
            to_run.append(episode_id)
            redis_state.assign_slot(run.id, episode_id)  # refilling a slot that a finished rollout released
    free = max(0, slots - running - len(to_run))
    in_prep = s.scalar(
        select(func.count()).where(Episode.run_id == run.id, Episode.status.in_(("preparing", "ready")))
    )
    want = max(0, free + sched.ready_depth - in_prep)
    to_prepare: list[int] = []
    if want:
        # Oldest groups first, so the groups of the current step finish before later ones.
        candidates = s.scalars(
            select(Episode.id)
            .where(Episode.run_id == run.id, Episode.status == "queued")
            .order_by(Episode.group_index, Episode.sample_index)
            .limit(want)
        ).all()
        for episode_id in candidates:
            if transition(s, Episode, episode_id, "preparing", expect=("queued",), **lease.dispatch_values()):
                to_prepare.append(episode_id)
    return to_prepare, to_run


def _close_complete_groups(s, run: Run, cfg: RunConfig) -> None:
    """Mark groups whose episodes are all terminal, judge them, and cut stragglers."""
    sched = cfg.scheduling
    open_groups = s.scalars(select(Group).where(Group.run_id == run.id, Group.status == "open")).all()
    next_step = s.scalar(select(func.count()).select_from(TrainingStep).where(TrainingStep.run_id == run.id))
    for group in open_groups:
        eps = s.scalars(
            select(Episode).where(Episode.run_id == run.id, Episode.group_index == group.group_index)
        ).all()
        usable = [e for e in eps if e.status == "completed" and e.reward is not None]
        unfinished = [e for e in eps if e.status not in TERMINAL]
        if unfinished and sched.cancel_stragglers and sched.min_usable and len(usable) >= sched.min_usable:
            for e in unfinished:
                if transition(s, Episode, e.id, "cancelled", error="straggler cancelled: group had enough graded episodes",
                              session_token_hash=None,
                              finished_at=utcnow()):
                    redis_state.flag_cancelled(e.id)
            unfinished = []
        if unfinished:
            continue
        group.completed_at = utcnow()
        if cfg.kind != "train":
            group.status = "done"
            continue
        if len(usable) < math.ceil(sched.min_accept_fraction * len(eps)) or not usable:
            group.status, group.reason = "rejected", f"{len(usable)}/{len(eps)} usable episodes"
            continue
        group.status = "accepted"
        if _judge_staleness(s, run, cfg, group) and sched.dynamic_sampling:
            _filter_uniform(s, run.id, sched.max_filtered_groups, group, next_step)
    s.flush()


def _usable_rewards(s, run_id: int, group: Group) -> list[float]:
    return list(s.scalars(select(Episode.reward).where(
        Episode.run_id == run_id, Episode.group_index == group.group_index, Episode.status == "completed",
        Episode.reward.is_not(None))))


def _filter_uniform(s, run_id: int, cap: int, group: Group, step: int) -> bool:
    """Set `group` aside for `step` when its usable rewards are all equal and the step's cap
    allows; True if it was set aside.

    Equal rewards give every episode advantage 0 under any group baseline (GRPO, Shao et al.
    2024, arXiv:2402.03300 §4.1.2), so training on the group moves nothing; DAPO (Yu et al. 2025,
    arXiv:2503.14476 §3.2) over-samples and keeps only groups with accuracy strictly between 0 and 1.
    """
    rewards = _usable_rewards(s, run_id, group)
    if len(set(rewards)) != 1:
        return False
    filtered = s.scalar(select(func.count()).where(Group.run_id == run_id, Group.status == "filtered", Group.step == step))
    if filtered >= cap:
        return False
    group.status, group.step = "filtered", step
    group.reason = f"all {len(rewards)} usable rewards are {rewards[0]:g}: no advantage (dynamic sampling)"
    return True


def _oldest_version(s, run_id: int, group_index: int) -> int | None:
    """The oldest policy version that produced the group's training data.

    Judged on the versions the engines stamped on the completions that will be trained (the
    weights that actually served them), not on the run's version when an episode started: if
    a weight sync failed, the engines kept serving the old weights while the run's version
    moved on.  Episodes without completions (simulated runs) fall back to their start version.
    Only the current attempt's rows count (`Completion.attempt >= Episode.attempts`).
    """
    completed = select(Episode.id).where(Episode.run_id == run_id, Episode.group_index == group_index,
                                         Episode.status == "completed")
    served = s.scalar(select(func.min(Completion.policy_version)).join(Episode, Episode.id == Completion.episode_id)
                      .where(Episode.id.in_(completed), Completion.attempt >= Episode.attempts,
                             Completion.rejected_reason.is_(None)))
    if served is not None:
        return served
    return s.scalar(select(func.min(Episode.policy_version)).where(Episode.id.in_(completed)))


def _judge_staleness(s, run: Run, cfg: RunConfig, group: Group) -> bool:
    """Drop or down-weight an accepted group whose data was served too many versions ago.

    Lag = the trainer's current policy version − the oldest version that served any of the
    group's completions (`_oldest_version`).  Checked when the group completes and again when
    a step is about to consume it (the policy may have moved on in between).  Returns True if
    the group is still usable.
    """
    sched = cfg.scheduling
    served = _oldest_version(s, run.id, group.group_index)
    lag = run.policy_version - served if served is not None else 0
    if lag <= sched.max_staleness:
        return True
    if sched.stale_policy == "drop":
        group.status, group.reason = "dropped", f"stale: served by version {served}, policy is {run.policy_version}"
        return False
    group.weight = 1.0 / (1 + lag - sched.max_staleness)
    return True


def _maybe_create_step(s, run: Run, cfg: RunConfig) -> int | None:
    steps = _steps(s, run.id)
    if len(steps) >= cfg.steps or any(st.status in ("pending", "training") for st in steps):
        return None
    candidates = s.scalars(
        select(Group)
        .where(Group.run_id == run.id, Group.status == "accepted")
        .order_by(Group.completed_at, Group.group_index)
    ).all()
    step = len(steps)
    accepted = [g for g in candidates if _judge_staleness(s, run, cfg, g)]
    if cfg.scheduling.dynamic_sampling:
        # A uniform group accepted after an earlier step's cap was reached is judged again against
        # this step's cap, so it does not take the place of a group with signal here.
        accepted = [g for g in accepted if not _filter_uniform(s, run.id, cfg.scheduling.max_filtered_groups, g, step)]
        # Past the cap, groups with signal still go first (stable: completion order within each kind).
        accepted.sort(key=lambda g: len(set(_usable_rewards(s, run.id, g))) == 1)
    accepted = accepted[: cfg.tasks_per_step]
    if len(accepted) < cfg.tasks_per_step:
        return None
    indexes = [g.group_index for g in accepted]
    episode_ids = s.scalars(
        select(Episode.id).where(Episode.run_id == run.id, Episode.group_index.in_(indexes), Episode.status == "completed")
        .order_by(Episode.group_index, Episode.sample_index)
    ).all()
    lags = [run.policy_version - (_oldest_version(s, run.id, g.group_index) or 0) for g in accepted]
    for g in accepted:
        g.status, g.step = "trained", step
    waits = redis_state.take_ready_waits(run.id)
    metrics = {"scheduling": scheduling_metrics(s, run.id, cfg.scheduling.rollout_slots, lags, waits)}
    s.add(TrainingStep(run_id=run.id, step=step, episode_ids=list(episode_ids), metrics=metrics))
    s.flush()
    return step


def _maybe_finish(s, run: Run, cfg: RunConfig) -> bool:
    if cfg.kind == "train":
        steps = _steps(s, run.id)
        if len(steps) < cfg.steps or any(st.status != "completed" for st in steps):
            if any(st.status == "failed" for st in steps):
                failed = next(st for st in steps if st.status == "failed")
                _cancel_unfinished(s, run.id, "run failed")
                run.summary = {**(run.summary or {}), **summarize_run(s, run.id)}
                transition(s, Run, run.id, "failed", error=f"training step {failed.step} failed: {failed.error}",
                           finished_at=utcnow())
                return True
            return False
        _cancel_unfinished(s, run.id, "run finished: extra in-flight episode not needed")
    else:
        unfinished = s.scalar(select(func.count()).where(Episode.run_id == run.id, Episode.status.not_in(TERMINAL)))
        if unfinished:
            return False
    run.summary = {**(run.summary or {}), **summarize_run(s, run.id)}
    done = transition(s, Run, run.id, "completed", finished_at=utcnow())
    if done:
        # Run-level scalars for every kind (train steps also log their own), at the last step.
        log_run_summary(run.id, cfg.kind, run.summary, step=cfg.steps if cfg.kind == "train" else 0,
                        config=run.config)
    return done


def _cancel_unfinished(s, run_id: int, reason: str) -> None:
    ids = s.scalars(select(Episode.id).where(Episode.run_id == run_id, Episode.status.not_in(TERMINAL))).all()
    for episode_id in ids:
        if transition(s, Episode, episode_id, "cancelled", error=reason, finished_at=utcnow(),
                      session_token_hash=None):  # the gateway refuses a cancelled episode's key at once
            redis_state.flag_cancelled(episode_id)
    s.execute(update(Group).where(Group.run_id == run_id, Group.status == "open").values(status="done", reason=reason))
    redis_state.clear_ready(run_id)


def _cancel_all(s, run: Run) -> None:
    _cancel_unfinished(s, run.id, "run cancelled")
    for st in _steps(s, run.id):
        if st.status == "pending":
            transition(s, TrainingStep, st.id, "failed", error="run cancelled")
    run.summary = {**(run.summary or {}), **summarize_run(s, run.id)}
    transition(s, Run, run.id, "cancelled", finished_at=utcnow())
