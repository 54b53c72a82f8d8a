"""The control loop: what to prepare, run, judge and train next for one run.

Every state change (run started, runtime prepared, episode graded, step trained,
cancel requested) calls `tick(run_id)`.  A tick reads the run's state from SQL,
decides, and enqueues Celery tasks; it never waits for work.  Ticks of one run
are serialised by a Redis lock; a tick that finds the lock taken marks the run
dirty so the holder runs one more pass (no event is lost).

Scheduling rules (DESIGN.md "Data flow"; issue 8 for the asynchronous parts):

* Groups: a train run keeps `tasks_per_step * (1 + async_level)` groups open, where
  async_level is `scheduling.max_async_level` in `async` mode and 0 in `sync` mode
  (sync also waits for the step in training before opening the next groups).
* READY buffer: episodes are prepared ahead up to `ready_depth` beyond the free
  rollout slots; prepared episode ids wait in a Redis list per run, so a slot
  that frees is refilled by the next tick without waiting for setup.
* Judging a complete group: fewer than `min_accept_fraction` usable episodes →
  rejected; started more than `max_staleness` versions before the current policy →
  dropped (or down-weighted).  Accepted groups train in completion order.
* Stragglers: with `cancel_stragglers`, a group with `min_usable` graded episodes
  has its unfinished episodes cancelled, freeing their slots at once.
"""
from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Iterator

import redis as redis_lib
from sqlalchemy import func, select, update

from app.config import get_settings
from app.db import session_scope
from app.models import Episode, Group, Run, TaskInstance, TrainingStep, utcnow
from app.runconfig import RunConfig
from app.states import transition

log = logging.getLogger("turnstile.scheduler")

TERMINAL = ("completed", "failed", "cancelled")
_redis: redis_lib.Redis | None = None


def redis_client() -> redis_lib.Redis:
    """Process-wide Redis client for `REDIS_URL` (READY buffers, locks, cancel flags)."""
    global _redis
    if _redis is None:
        _redis = redis_lib.Redis.from_url(get_settings().redis_url)
    return _redis


def reset_redis() -> None:
    global _redis
    _redis = None


def ready_key(run_id: int) -> str:
    return f"turnstile:run:{run_id}:ready"


def slot_free_key(run_id: int) -> str:
    """Redis list of times (unix s) at which a rollout slot of the run became free."""
    return f"turnstile:run:{run_id}:slot_free"


def slot_wait_key(run_id: int) -> str:
    """Redis hash episode_id -> time its slot became free (for the READY-wait metric)."""
    return f"turnstile:run:{run_id}:slot_wait"


def ready_waits_key(run_id: int) -> str:
    """Redis list of measured READY waits (s): slot free -> rollout started."""
    return f"turnstile:run:{run_id}:ready_waits"


def cancel_key(episode_id: int) -> str:
    return f"turnstile:episode:{episode_id}:cancel"


def celery_priority(run_priority: int) -> int:
    """Map a run's priority (0 low .. 9 high) to kombu's Redis priority (0 is served first)."""
    return max(0, min(9, 9 - run_priority))


@contextlib.contextmanager
def _run_lock(run_id: int) -> Iterator[bool]:
    r = redis_client()
    key = f"turnstile:run:{run_id}:lock"
    token = str(id(object()))
    got = bool(r.set(key, token, nx=True, px=30_000))
    try:
        yield got
    finally:
        if got and r.get(key) == token.encode():
            r.delete(key)


def tick(run_id: int) -> None:
    """Advance run `run_id` as far as its current state allows (idempotent).

    Every caller first marks the run dirty, then tries the lock; the holder keeps
    making passes while the mark is set, and looks once more after releasing the
    lock.  So a state change that arrives while another process holds the lock is
    always seen by some pass (no lost wake-up).
    """
    r = redis_client()
    dirty = f"turnstile:run:{run_id}:dirty"
    r.set(dirty, 1, px=600_000)
    while True:
        with _run_lock(run_id) as got:
            if not got:
                return  # the holder will see the mark
            while r.getdel(dirty):
                _tick_locked(run_id)
        if not r.get(dirty):
            return


# --- run start ----------------------------------------------------------------------


def start_run(run_id: int) -> bool:
    """Move a queued run to running, load its task instances, and take the first tick."""
    with session_scope() as s:
        won = transition(s, Run, run_id, "running", started_at=utcnow())
        run = s.get(Run, run_id)
        if run is None or run.status != "running":
            return False
        cfg = RunConfig.model_validate(run.config)
        has_plan = bool((run.summary or {}).get("instance_ids"))
    _claim_run_dir(run_id, run.created_at.isoformat())
    if not has_plan:
        try:
            if cfg.model.checkpoint:
                _load_checkpoint(run_id, cfg)
            elif cfg.simulate is None and cfg.model.engine == "embedded":
                _start_from_base(run_id, cfg)
            instance_ids = _load_instances(cfg)
        except Exception as exc:  # a bad task set fails the run with the reason, not silently
            with session_scope() as s:
                transition(s, Run, run_id, "failed", error=f"starting the run: {exc}"[:1000], finished_at=utcnow())
            return False
        with session_scope() as s:
            run = s.get(Run, run_id)
            run.summary = {**(run.summary or {}), "instance_ids": instance_ids}
    log.info("run=%s event=start won=%s", run_id, won)
    tick(run_id)
    return True


def _claim_run_dir(run_id: int, created_at: str) -> None:
    """Make `<var_dir>/runs/<id>/` this run's own: move aside a folder left by another database's run `id`.

    Checkpoint resume reads that folder, so a stale one (same id, other DB or a
    wiped DB) must never be mistaken for this run's progress.
    """
    import json
    import time

    settings = get_settings()
    root = settings.var_dir / "runs" / str(run_id)
    marker = root / "run.json"
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


def resolve_checkpoint(spec: str) -> tuple[Path, int]:
    """(model folder, policy version) of `spec`: a folder, or 'run:<id>' for a run's newest checkpoint.

    Raises FileNotFoundError when there is no such checkpoint.
    """
    import json

    if spec.startswith("run:"):
        root = get_settings().var_dir / "runs" / spec.removeprefix("run:") / "checkpoints"
        steps = sorted((p for p in root.glob("step_*") if (p / "model").is_dir()),
                       key=lambda p: int(p.name.removeprefix("step_")))
        if not steps:
            raise FileNotFoundError(f"{spec}: no checkpoint under {root}")
        folder = steps[-1] / "model"
    else:
        folder = Path(spec)
        if not folder.is_dir():
            raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    meta = folder / "turnstile.json"
    version = json.loads(meta.read_text()).get("policy_version", 0) if meta.is_file() else 0
    return folder, int(version or 0)


def _load_checkpoint(run_id: int, cfg: RunConfig) -> None:
    """Load the run's checkpoint into every engine (through the reload gate) before any episode."""
    from app.training.weight_sync import push_weights

    folder, version = resolve_checkpoint(cfg.model.checkpoint)
    urls = cfg.model.engine_urls or get_settings().engine_urls
    results = push_weights(urls, folder, version, engine_kind=cfg.model.engine)
    failed = {u: r for u, r in results.items() if r != "ok"}
    if failed:
        raise RuntimeError(f"engines did not load {folder}: {failed}")
    with session_scope() as s:
        s.get(Run, run_id).policy_version = version


def _start_from_base(run_id: int, cfg: RunConfig) -> None:
    """Serve the base weights (version 0) unless another run is using the same engines.

    Engines are shared by every run of a deployment; a run that starts from the base model must
    not sample from a previous run's trained weights.  While another real run is running, its
    weights are left alone and this run records which run it shares the engines with.
    """
    from app.training.weight_sync import reset_to_base

    with session_scope() as s:
        others = [r.id for r in s.scalars(select(Run).where(Run.status == "running", Run.id != run_id))
                  if r.config.get("simulate") is None]
    if others:
        with session_scope() as s:
            run = s.get(Run, run_id)
            run.summary = {**(run.summary or {}), "engines_shared_with_runs": others}
        log.warning("run=%s event=shared_engines others=%s: not resetting the engines' weights", run_id, others)
        return
    urls = cfg.model.engine_urls or get_settings().engine_urls
    failed = {u: r for u, r in reset_to_base(urls).items() if r != "ok"}
    if failed:
        # e.g. a scripted test engine without weights; every completion still carries the
        # version that actually answered it, so this is recorded, not fatal.
        log.warning("run=%s event=base_reset_failed engines=%s", run_id, failed)
        with session_scope() as s:
            run = s.get(Run, run_id)
            run.summary = {**(run.summary or {}), "engines_not_reset": failed}


def _load_instances(cfg: RunConfig) -> list[int]:
    """TaskInstance row ids the run cycles through (simulated runs get placeholder instances)."""
    with session_scope() as s:
        if cfg.simulate is not None:
            names = cfg.instances or [f"sim-{i}" for i in range(cfg.tasks_per_step)]
            ids = []
            for name in names:
                row = s.scalar(select(TaskInstance).where(TaskInstance.task_set == "simulated", TaskInstance.instance_id == name))
                if row is None:
                    row = TaskInstance(task_set="simulated", instance_id=name, repo="simulated", record={"instance_id": name})
                    s.add(row)
                    s.flush()
                ids.append(row.id)
            return ids
    from app.tasksets import load_task_set, upsert_instances

    task_set = load_task_set(cfg.task_set)
    wanted = cfg.instances or [r.instance_id for r in task_set.instances]
    records = [task_set.get(name) for name in wanted]  # KeyError names a missing instance
    with session_scope() as s:
        ids = upsert_instances(s, task_set.name, records)
    return [ids[name] for name in wanted]


# --- the tick -----------------------------------------------------------------------


def _tick_locked(run_id: int) -> None:
    with session_scope() as s:
        run = s.get(Run, run_id)
        if run is None:
            return
        if run.status == "cancelling":
            _cancel_all(s, run)
            return
        if run.status != "running":
            return
        cfg = RunConfig.model_validate(run.config)
        if _too_many_failures(s, run, cfg):
            return
        _close_complete_groups(s, run, cfg)
        if cfg.kind == "train":
            _plan_train(s, run, cfg)
        else:
            _plan_eval(s, run, cfg)
        to_prepare, to_run = _dispatch(s, run, cfg)
        step_to_train = _maybe_create_step(s, run, cfg) if cfg.kind == "train" else None
        finished = _maybe_finish(s, run, cfg)
        priority = celery_priority(run.priority)
    # Enqueue only after the transitions above are committed (commit, then enqueue).
    from app.tasks import episodes as ep_tasks
    from app.tasks.control import enqueue_train_step

    for episode_id in to_prepare:
        ep_tasks.prepare_episode.apply_async(args=[episode_id], priority=priority)
    for episode_id in to_run:
        ep_tasks.run_episode.apply_async(args=[episode_id], priority=priority)
    if step_to_train is not None:
        enqueue_train_step(run_id, step_to_train, simulated=cfg.simulate is not None)
    if finished:
        log.info("run=%s event=finished", run_id)


def _too_many_failures(s, run: Run, cfg: RunConfig) -> bool:
    """Fail the run (with the latest episode error) instead of retrying a broken setup forever."""
    limit = cfg.scheduling.max_failed_episodes or 2 * cfg.group_size * cfg.tasks_per_step
    failed = s.scalar(select(func.count()).where(Episode.run_id == run.id, Episode.status == "failed"))
    if failed < limit:
        return False
    last = s.scalar(select(Episode.error).where(Episode.run_id == run.id, Episode.status == "failed")
                    .order_by(Episode.finished_at.desc()).limit(1))
    _cancel_unfinished(s, run.id, "run failed: too many failed episodes")
    run.summary = {**(run.summary or {}), **_summary(s, run.id)}
    transition(s, Run, run.id, "failed", finished_at=utcnow(),
               error=f"{failed} episodes failed (limit {limit}); last error: {last}")
    return True


def _summary(s, run_id: int) -> dict:
    from app.summary import summarize_run

    return summarize_run(s, run_id)


def _new_group(s, run: Run, instance_ids: list[int], group_index: int, group_size: int, step: int) -> None:
    instance_id = instance_ids[group_index % len(instance_ids)]
    s.add(Group(run_id=run.id, group_index=group_index, instance_id=instance_id, policy_version=run.policy_version))
    for k in range(group_size):
        s.add(Episode(run_id=run.id, instance_id=instance_id, step=step, group_index=group_index, sample_index=k))
    s.flush()


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
    """Start rollouts for free slots from the READY buffer, and prepare ahead to refill it."""
    r = redis_client()
    sched = cfg.scheduling
    running = s.scalar(select(func.count()).where(Episode.run_id == run.id, Episode.status == "running"))
    to_run: list[int] = []
    while running + len(to_run) < sched.rollout_slots:
        raw = r.rpop(ready_key(run.id))
        if raw is None:
            break
        episode_id = int(raw)
        if transition(s, Episode, episode_id, "running", expect=("ready",)):
            to_run.append(episode_id)
            freed = r.lpop(slot_free_key(run.id))
            if freed is not None:  # refilling a slot that a finished rollout released
                r.hset(slot_wait_key(run.id), episode_id, freed)
    free = sched.rollout_slots - running - len(to_run)
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
            if transition(s, Episode, episode_id, "preparing", expect=("queued",)):
                to_prepare.append(episode_id)
    return to_prepare, to_run


def _close_complete_groups(s, run: Run, cfg: RunConfig) -> None:
    """Mark groups whose episodes are all terminal, judge them, and cut stragglers."""
    sched = cfg.scheduling
    open_groups = s.scalars(select(Group).where(Group.run_id == run.id, Group.status == "open")).all()
    for group in open_groups:
        eps = s.scalars(
            select(Episode).where(Episode.run_id == run.id, Episode.group_index == group.group_index)
        ).all()
        usable = [e for e in eps if e.status == "completed" and e.reward is not None]
        unfinished = [e for e in eps if e.status not in TERMINAL]
        if unfinished and sched.cancel_stragglers and sched.min_usable and len(usable) >= sched.min_usable:
            for e in unfinished:
                if transition(s, Episode, e.id, "cancelled", error="straggler cancelled: group had enough graded episodes",
                              finished_at=utcnow()):
                    redis_client().set(cancel_key(e.id), 1, ex=24 * 3600)
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
        _judge_staleness(s, run, cfg, group)
    s.flush()


def _judge_staleness(s, run: Run, cfg: RunConfig, group: Group) -> bool:
    """Drop or down-weight an accepted group whose episodes started too many versions ago.

    Lag = current policy version − the oldest version any of its usable episodes started
    under.  Checked when the group completes and again when a step is about to consume it
    (the policy may have moved on in between).  Returns True if the group is still usable.
    """
    sched = cfg.scheduling
    started = s.scalar(
        select(func.min(Episode.policy_version)).where(
            Episode.run_id == run.id, Episode.group_index == group.group_index, Episode.status == "completed"
        )
    )
    lag = run.policy_version - started if started is not None else 0
    if lag <= sched.max_staleness:
        return True
    if sched.stale_policy == "drop":
        group.status, group.reason = "dropped", f"stale: started at version {started}, policy is {run.policy_version}"
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
    accepted = [g for g in candidates if _judge_staleness(s, run, cfg, g)][: cfg.tasks_per_step]
    if len(accepted) < cfg.tasks_per_step:
        return None
    step = len(steps)
    indexes = [g.group_index for g in accepted]
    episode_ids = s.scalars(
        select(Episode.id).where(Episode.run_id == run.id, Episode.group_index.in_(indexes), Episode.status == "completed")
        .order_by(Episode.group_index, Episode.sample_index)
    ).all()
    lags = [run.policy_version - (s.scalar(select(func.min(Episode.policy_version)).where(
        Episode.run_id == run.id, Episode.group_index == g.group_index, Episode.status == "completed")) or 0)
        for g in accepted]
    for g in accepted:
        g.status, g.step = "trained", step
    from app.summary import scheduling_metrics

    waits = [float(w) for w in redis_client().lrange(ready_waits_key(run.id), 0, -1)]
    redis_client().delete(ready_waits_key(run.id))
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
                run.summary = {**(run.summary or {}), **_summary(s, run.id)}
                transition(s, Run, run.id, "failed", error=f"training step {failed.step} failed: {failed.error}",
                           finished_at=utcnow())
                return True
            return False
        _cancel_unfinished(s, run.id, "run finished: extra in-flight episode not needed")
    else:
        unfinished = s.scalar(select(func.count()).where(Episode.run_id == run.id, Episode.status.not_in(TERMINAL)))
        if unfinished:
            return False
    run.summary = {**(run.summary or {}), **_summary(s, run.id)}
    return transition(s, Run, run.id, "completed", finished_at=utcnow())


def _cancel_unfinished(s, run_id: int, reason: str) -> None:
    ids = s.scalars(select(Episode.id).where(Episode.run_id == run_id, Episode.status.not_in(TERMINAL))).all()
    for episode_id in ids:
        if transition(s, Episode, episode_id, "cancelled", error=reason, finished_at=utcnow()):
            redis_client().set(cancel_key(episode_id), 1, ex=24 * 3600)
    s.execute(update(Group).where(Group.run_id == run_id, Group.status == "open").values(status="done", reason=reason))
    redis_client().delete(ready_key(run_id))


def _cancel_all(s, run: Run) -> None:
    _cancel_unfinished(s, run.id, "run cancelled")
    for st in _steps(s, run.id):
        if st.status == "pending":
            transition(s, TrainingStep, st.id, "failed", error="run cancelled")
    run.summary = {**(run.summary or {}), **_summary(s, run.id)}
    transition(s, Run, run.id, "cancelled", finished_at=utcnow())
