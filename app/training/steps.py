"""One GRPO training step of a run, end to end, idempotent and resumable.

    train_step(run_id, step, episode_ids)
      claim      TrainingStep row pending|training -> training  (completed: return its metrics)
      restore    resident trainer holds the weights after step-1: kept in memory, or loaded
                 from the newest complete checkpoint (weights + optimizer), or the base model
      data       per episode: trajectories built and stored (app.training.store), rewards,
                 group advantages (app.training.grpo) x the group's staleness weight
      update     Trainer.update: one GRPO step
      checkpoint <var_dir>/runs/<run>/checkpoints/step_<k>/, atomic (app.training.checkpoints);
                 its path goes on the row at once (a `training` row with a checkpoint is pushing weights)
      sync       every engine loads the new weights (app.training.weight_sync)
      record     TrainingStep completed with metrics; Run.policy_version bumped; TensorBoard.
                 An engine that did not load them fails the step by name instead
                 (`WeightSyncError`, error "weight sync failed: <url>: <reason>"), and the run with it

Steps are numbered from 0 as the scheduler creates them; the policy version after step k is
the loaded state's version + 1 (k + 1 when steps run in order from the base model).
A worker killed mid-step leaves the row in `training`: running `train_step` again for that
step resumes — from the step's own checkpoint if it was already written (only the engine
sync and bookkeeping are redone), otherwise from step k-1's checkpoint.
The model and optimizer stay resident in the process between steps (`_RESIDENT`).
"""
from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select, update

from app import versions
from app.config import get_settings
from app.db import session_scope
from app.paths import RunPaths
from app.tables import Episode, Group, Run, TrainingStep, utcnow
from app.transitions import transition
from app.training import checkpoints, opd
from app.runconfig import TrainingConfig
from app.training.batching import StepSequence
from app.training.grpo import group_advantages
from app.training.replay_routes import NO_ROUTES, trajectory_routes
from app.training.store import build_episode_trajectories, trajectory_transform
from app.training.tracking import log_scalars
from app.training.weight_sync import ensure_weights, push_adapter, push_weights, pushes_to

ADAPTER_DIR = "adapter"  # a LoRA checkpoint's engine adapter folder (Trainer.save)

log = logging.getLogger(__name__)


class StepError(RuntimeError):
    """A step that cannot run: it failed before, or the checkpoint it must resume from is missing."""


class WeightSyncError(StepError):
    """The step trained and wrote its checkpoint, but an engine did not load the new weights (after
    `push_weights`' retries): the step is recorded `failed` with this message as its `error`."""


def weight_sync_error(results: dict[str, str]) -> str | None:
    """`"weight sync failed: <url>: <reason>; …"` for the engines of `results` (`push_weights`'
    `{url: "ok" | "error: …"}`) that did not load; None when all did."""
    failed = [f"{url}: {result.removeprefix('error: ')}" for url, result in sorted(results.items()) if result != "ok"]
    return ("weight sync failed: " + "; ".join(failed))[:2000] if failed else None


@dataclass
class _Resident:
    run_id: int | None = None
    key: tuple | None = None  # (model spec, training config) the trainer was built for
    trainer: object | None = None
    step: int | None = None  # the step whose weights it holds (None: base model)
    policy_version: int = 0
    pool: object | None = None  # LoRA runs: the tenant pool on `trainer` (app.training.tenants)


_RESIDENT = _Resident()


def reset_resident() -> None:
    """Forget the resident trainer (what a fresh worker process starts with)."""
    global _RESIDENT
    _RESIDENT = _Resident()


def _trainer_for(run_id: int, spec: str, config: TrainingConfig):
    from app.training.threads import apply_cpu_threads
    from app.training.trainer import Trainer  # torch: imported in the worker child only

    apply_cpu_threads()  # before any torch work of this process: the cores the engine and rollouts leave

    key = (spec, tuple(sorted(config.to_dict().items())))
    if _RESIDENT.run_id == run_id and _RESIDENT.key == key and _RESIDENT.trainer is not None:
        return _RESIDENT.trainer
    pool = _RESIDENT.pool
    if pool is None or not pool.accepts(spec, config):
        reset_resident()  # free the previous run's model before loading the next
        _RESIDENT.trainer = Trainer.from_spec(config, spec)
        if config.lora and _RESIDENT.trainer.group is None:
            from app.training.tenants import TenantPool

            _RESIDENT.pool = pool = TenantPool(_RESIDENT.trainer, spec)
    if pool is not None:
        # Another LoRA run of the same shape: park its adapter and optimizer state, swap this one in.
        if _RESIDENT.run_id is not None and _RESIDENT.run_id in pool.tenants:
            pool.mark(_RESIDENT.run_id, step=_RESIDENT.step, policy_version=_RESIDENT.policy_version)
        marks = pool.activate(run_id, config)
        _RESIDENT.step, _RESIDENT.policy_version = marks.get("step"), marks.get("policy_version", 0)
    _RESIDENT.run_id, _RESIDENT.key = run_id, key
    return _RESIDENT.trainer


def _forget(run_id: int) -> None:
    """Drop run `run_id`'s resident state (its weights may be half-updated): its tenant alone
    when it is one of a LoRA pool (the other runs' adapters stay), else the whole trainer."""
    if _RESIDENT.pool is not None and _RESIDENT.run_id == run_id:
        _RESIDENT.pool.drop(run_id)
        _RESIDENT.run_id, _RESIDENT.key, _RESIDENT.step, _RESIDENT.policy_version = None, None, None, 0
    elif _RESIDENT.pool is not None:
        _RESIDENT.pool.drop(run_id)
    else:
        reset_resident()


def _restore(run_id: int, step: int, spec: str, config: TrainingConfig, completed_before: bool):
    """Make the resident trainer hold the state after step-1; return (trainer, own checkpoint or None)."""
    trainer = _trainer_for(run_id, spec, config)
    found = dict(checkpoints.complete_checkpoints(run_id))
    if step in found:  # this step's checkpoint was written before a crash
        if _RESIDENT.step != step:
            state = trainer.load(found[step])
            _RESIDENT.step, _RESIDENT.policy_version = step, int(state["policy_version"])
        return trainer, found[step]
    if _RESIDENT.step is not None and _RESIDENT.step == step - 1:
        return trainer, None
    earlier = [k for k in found if k < step]
    if earlier:
        if max(earlier) != step - 1:
            raise StepError(f"step {step} needs the checkpoint of step {step - 1}; the newest earlier one is step {max(earlier)}")
        state = trainer.load(found[step - 1])
        _RESIDENT.step, _RESIDENT.policy_version = step - 1, int(state["policy_version"])
        return trainer, None
    if completed_before:
        raise StepError(f"run {run_id} has completed steps before {step} but no checkpoint to resume from")
    if _RESIDENT.step is not None:  # holds a later state than this step needs: start over from the base
        _forget(run_id)
        trainer = _trainer_for(run_id, spec, config)
    return trainer, None


def train_step(run_id: int, step: int, episode_ids: list[int] | None = None) -> dict:
    """Run (or finish, or skip) training step `step` of run `run_id`; return its metrics.

    `episode_ids`: the graded episodes of the step's groups; optional when the
    `TrainingStep` row already lists them (the scheduler creates the row).  A completed step
    returns its stored metrics without doing anything; while another process holds the run's
    training lock it returns `{"skipped": …}`.  Raises `LookupError` (unknown run or
    episode), `ValueError` (bad training config, no episodes), `StepError` (see the class).
    On an error the row keeps status `training` with `error` set, so calling again resumes;
    except `WeightSyncError`, which is recorded on the row as `failed` (its checkpoint kept).
    """
    with checkpoints.run_lock(run_id) as acquired:
        if not acquired:
            # A duplicate message: the process holding the lock finishes (or fails) the step,
            # so this one must not report a failure for it.
            log.warning("run=%s step=%s is being trained by another process; skipping", run_id, step)
            return {"skipped": "another process is training this run"}
        try:
            return _train_step(run_id, step, episode_ids)
        except BaseException as exc:
            # The resident weights may be half-updated: the next attempt reloads a checkpoint.
            _forget(run_id)
            with session_scope() as s:
                s.execute(update(TrainingStep).where(TrainingStep.run_id == run_id, TrainingStep.step == step,
                                                     TrainingStep.status == "training")
                          .values(error=f"{type(exc).__name__}: {exc}"[:2000]))
            raise


def _train_step(run_id: int, step: int, episode_ids: list[int] | None) -> dict:
    start = time.perf_counter()
    with session_scope() as s:
        run = s.get(Run, run_id)
        if run is None:
            raise LookupError(f"run {run_id} does not exist")
        row = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id, TrainingStep.step == step))
        if row is None:
            if not episode_ids:
                raise ValueError(f"step {step} of run {run_id} has no row and no episode_ids were given")
            row = TrainingStep(run_id=run_id, step=step, status="pending", episode_ids=list(episode_ids))
            s.add(row)
            s.flush()
        if row.status == "completed":
            return dict(row.metrics or {})
        if run.status not in ("running",):
            # A cancelled or failed run's step (e.g. re-sent by the watchdog) must not hold the trainer.
            if _RESIDENT.pool is not None and _RESIDENT.run_id != run_id:
                _RESIDENT.pool.drop(run_id)  # its adapter only; the active run's stays installed
            transition(s, TrainingStep, row.id, "failed", error=f"run is {run.status}", finished_at=utcnow())
            return {"skipped": f"run {run_id} is {run.status}"}
        if row.status == "failed":
            raise StepError(f"step {step} of run {run_id} failed before: {row.error}")
        episode_ids = list(row.episode_ids or episode_ids or [])
        if not episode_ids:
            raise ValueError(f"step {step} of run {run_id} lists no episodes")
        transition(s, TrainingStep, row.id, "training", expect=("pending", "training"), error=None,
                   **row.start_values(utcnow()))
        run_cfg = run.run_config()
        spec, config = run_cfg.model.name, run_cfg.training
        # A train run that starts from a checkpoint trains those weights: the folder its engines
        # loaded at its start (`Run.start_weights`), so trainer and engines hold one base.
        start_weights = run.start_weights()
        if start_weights is not None:
            spec = start_weights[0]
        elif run_cfg.model.checkpoint:
            spec = str(checkpoints.resolve_checkpoint(run_cfg.model.checkpoint)[0])
        engine_urls = run_cfg.model.engine_urls or get_settings().engine_urls
        engine_kind = run_cfg.model.engine
        update_mode, recompute_kv = run_cfg.model.weight_update_mode, run_cfg.model.recompute_kv
        completed_before = s.scalar(select(TrainingStep.id).where(
            TrainingStep.run_id == run_id, TrainingStep.step < step, TrainingStep.status == "completed").limit(1)) is not None

    resident = _RESIDENT.trainer is not None and _RESIDENT.run_id == run_id
    trainer, own = _restore(run_id, step, spec, config, completed_before)
    if own is not None:
        state = _read_state(own)
        metrics, policy_version, path = state["metrics"], int(state["policy_version"]), own
        metrics["resumed_from_checkpoint"] = True
    else:
        waited = None
        if config.algorithm != "grpo":  # the teacher worker scores the chains (sent with this step)
            waited = opd.wait_for_scores(run_id, step, episode_ids, config, trainer.vocab_size)
        sequences, metrics = step_sequences(run_id, episode_ids, config, trainer.vocab_size,
                                            policy_version=_RESIDENT.policy_version)
        if waited is not None:
            metrics["opd"]["teacher_wait_s"] = waited
        metrics.update(trainer.update(sequences))
        policy_version = _RESIDENT.policy_version + 1
        metrics["policy_version"] = policy_version
        metrics["step_time_s"] = time.perf_counter() - start
        state = {"run_id": run_id, "step": step, "policy_version": policy_version, "episode_ids": episode_ids,
                 "metrics": metrics, "config": config.to_dict(), "model": spec}
        saved = time.perf_counter()
        path = checkpoints.write_checkpoint(RunPaths(run_id).checkpoint(step), lambda tmp: trainer.save(tmp, state))
        metrics["checkpoint_time_s"] = time.perf_counter() - saved
        _RESIDENT.step, _RESIDENT.policy_version = step, policy_version

    # The checkpoint is on disk; what is left is the engines' weight load.  The row says so while
    # it runs (`checkpoint_path` on a `training` row reads "pushing weights": app.api.trainer_state).
    with session_scope() as s:
        s.execute(update(TrainingStep).where(TrainingStep.run_id == run_id, TrainingStep.step == step,
                                             TrainingStep.status == "training").values(checkpoint_path=str(path)))
    metrics["trainer_resident"] = resident  # model + optimizer were already in this process's memory
    synced = time.perf_counter()
    if _RESIDENT.pool is not None and (engine_kind == "vllm" or not any(pushes_to(u) for u in engine_urls)):
        # A LoRA tenant: the engines keep the shared base and serve this run's adapter by name (read
        # from the shared disk, as vLLM reads every checkpoint; an embedded engine on another
        # machine still gets the merged full weights).
        from app.engines.lora_format import adapter_name, run_label

        metrics["adapter"] = adapter_name(run_label(run_id), path / ADAPTER_DIR)
        # An engine restarted since the run started serves its own base, not the run's starting
        # checkpoint: the adapter would be sampled on weights it was not trained on.
        base = ensure_weights(engine_urls, Path(start_weights[0]), start_weights[1],
                              engine_kind=engine_kind) if start_weights else {}
        on_base = [url for url in engine_urls if base.get(url, "ok") == "ok"]
        metrics["engine_sync"] = {**base, **push_adapter(on_base, path / ADAPTER_DIR, metrics["adapter"],
                                                         policy_version, engine_kind=engine_kind)}
    else:
        metrics["engine_sync"] = push_weights(engine_urls, path / "model", policy_version, engine_kind=engine_kind,
                                              mode=update_mode, recompute_kv=recompute_kv)
    metrics["engine_sync_time_s"] = time.perf_counter() - synced
    # Engines that did not load the new weights (after push_weights' retries) keep serving the old
    # version (under every update mode: a failed load changes nothing) and stamp it on their
    # completions; the step fails by name, and with it the run (`scheduler._maybe_finish`).
    metrics["engine_sync_failed"] = sorted(url for url, result in metrics["engine_sync"].items() if result != "ok")
    sync_error = weight_sync_error(metrics["engine_sync"])
    if sync_error:
        log.error("run=%s step=%s policy_version=%s %s", run_id, step, policy_version, sync_error)

    with session_scope() as s:
        row = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id, TrainingStep.step == step))
        if not transition(s, TrainingStep, row.id, "failed" if sync_error else "completed", expect=("training",),
                          metrics={**(row.metrics or {}), **metrics},  # keep the scheduler's metrics
                          policy_version=policy_version, checkpoint_path=str(path), finished_at=utcnow(),
                          error=sync_error):
            log.warning("run=%s step=%s left `training` while it ran (now %s); its checkpoint stays", run_id, step,
                        row.status)
        if not sync_error:
            s.execute(update(Run).where(Run.id == run_id, Run.policy_version < policy_version)
                      .values(policy_version=policy_version))
    _log_tensorboard(run_id, step, metrics, run_cfg.model_dump(mode="json"))
    checkpoints.prune_checkpoints(run_id)
    if sync_error:
        raise WeightSyncError(sync_error)
    log.info("run=%s step=%s policy_version=%s loss=%.4g tokens=%s time=%.1fs", run_id, step, policy_version,
             metrics.get("loss") or 0.0, metrics.get("tokens_trained"), time.perf_counter() - start)
    return metrics


def _read_state(path: Path) -> dict:
    return json.loads((path / "trainer_state.json").read_text())


def policy_lag(row, policy_version: int | None) -> int:
    """Versions by which the oldest policy that sampled any token of trajectory `row` lags
    `policy_version`: the oldest of its `meta.policy_versions` (each completion's first token's,
    None where the engine did not say) and of its spans' per-token `meta.version_runs`; 0 when
    either side is unknown.  Staleness is judged by the oldest token a chain trains on."""
    meta = row.meta or {}
    found = [v for v in meta.get("policy_versions") or [] if v is not None]
    found += [v for runs in meta.get("version_runs") or [] if runs for _, v in runs]
    if policy_version is None or not found:
        return 0
    return max(0, policy_version - min(found))


def token_lags(row, policy_version: int | None) -> list[int] | None:
    """Per-position lags ([T] ints, 0 on context tokens) of a chain whose spans cross an in-flight
    weight update (`meta.version_runs`); None when every span has one version (its `policy_lag`
    then holds for every token, as for every chain stored before per-token capture)."""
    meta = row.meta or {}
    span_runs = meta.get("version_runs") or []
    if policy_version is None or not any(span_runs):
        return None
    lags = [0] * len(row.token_ids)
    for (start, end), runs, version in zip(meta.get("spans") or [], span_runs, meta.get("policy_versions") or []):
        for i, v in enumerate(versions.expand(runs, end - start, version)):
            lags[start + i] = max(0, policy_version - v) if v is not None else 0
    return lags


def step_sequences(run_id: int, episode_ids: list[int], config: TrainingConfig, vocab_size: int,
                   policy_version: int | None = None):
    """Trajectories of the step's episodes with their advantages, and the data metrics.

    Returns `(list[StepSequence], metrics)`; metrics: episodes, groups, reward_mean,
    reward_std, resolved_rate, advantage_mean/std/min/max (per episode),
    zero_advantage_group_fraction, and the summed merge report (`merge`).
    Every sequence of an episode carries that episode's advantage, scaled by its group's
    `weight` (< 1 for groups the scheduler down-weighted for staleness), and its `policy_lag`
    behind `policy_version` (the version of the weights the trainer holds; None: all 0).
    With `config.routing_replay` each sequence carries its chain's routes (`trajectory_routes`);
    a chain recorded without them is left out, counted in `merge.sequences_no_routes` and, per
    completion of it, as `NO_ROUTES` in `merge.rejected_reasons` (never trained unreplayed).
    """
    with session_scope() as s:
        episodes = list(s.scalars(select(Episode).where(Episode.id.in_(episode_ids), Episode.run_id == run_id)))
        missing = sorted(set(episode_ids) - {e.id for e in episodes})
        if missing:
            raise LookupError(f"episodes {missing} are not episodes of run {run_id}")
        group_rows = s.scalars(select(Group).where(Group.run_id == run_id,
                                                   Group.group_index.in_({e.group_index for e in episodes})))
        weights = {g.group_index: g.weight for g in group_rows}
        groups: dict[int, list[Episode]] = defaultdict(list)
        for e in sorted(episodes, key=lambda e: (e.group_index, e.sample_index)):
            groups[e.group_index].append(e)
        advantage: dict[int, float] = {}
        zero_groups = 0
        for index, members in groups.items():
            rewards = [e.reward if e.status == "completed" else None for e in members]
            values = group_advantages(rewards, config.advantage_mode, config.normalize_advantage_std)
            zero_groups += all(v == 0.0 for v in values)
            for e, v in zip(members, values):
                advantage[e.id] = v * weights.get(index, 1.0)
        sequences: list[StepSequence] = []
        distill = opd.StepDistillation(s, config) if config.algorithm != "grpo" else None
        merge = Counter()
        cut_reasons, rejected_reasons = Counter(), Counter()
        for e in episodes:
            rows, report = build_episode_trajectories(s, e.id, config.builder, vocab_size)
            for row in rows:
                # Trajectories built before the model was known (at grading time) were not
                # checked against its vocabulary; an id beyond the embedding would crash the step.
                if row.token_ids and max(row.token_ids) >= vocab_size:
                    merge["sequences_out_of_vocab"] += 1
                    continue
                routes = trajectory_routes(row) if config.routing_replay else None
                if config.routing_replay and routes is None:
                    merge["sequences_no_routes"] += 1
                    rejected_reasons[NO_ROUTES] += max(1, len(row.completion_ids or []))
                    continue
                sequence = StepSequence(row.token_ids, row.loss_mask, row.logprobs, advantage[e.id], e.id,
                                        trajectory_transform(row), policy_lag(row, policy_version),
                                        token_lags(row, policy_version), routes)
                if distill is not None:  # per-token advantages; a chain without teacher scores is never trained
                    sequence = distill.sequence(row, sequence)
                    if sequence is None:
                        continue
                sequences.append(sequence)
            for key in ("completions", "rejected", "chains", "completions_merged", "chains_cut", "tokens", "trainable_tokens"):
                merge[key] += int(report.get(key, 0))
            cut_reasons.update(report.get("cut_reasons", {}))
            rejected_reasons.update(report.get("rejected_reasons", {}))
        rewards = [e.reward for e in episodes if e.status == "completed" and e.reward is not None]
        resolved = [bool(e.resolved) for e in episodes if e.resolved is not None]
        advs = list(advantage.values())
        distill_metrics = None
        if distill is not None:
            sequences = distill.finish(sequences)  # the step's baseline, when the run asks for one
            distill_metrics = distill.metrics()
    metrics = {
        "episodes": len(episodes),
        "groups": len(groups),
        "reward_mean": _mean(rewards),
        "reward_std": _std(rewards),
        "resolved_rate": _mean([float(r) for r in resolved]),
        "advantage_mean": _mean(advs),
        "advantage_std": _std(advs),
        "advantage_min": min(advs) if advs else 0.0,
        "advantage_max": max(advs) if advs else 0.0,
        "zero_advantage_group_fraction": zero_groups / len(groups) if groups else 0.0,
        "builder": config.builder,
        "merge": {**merge, "cut_reasons": dict(cut_reasons), "rejected_reasons": dict(rejected_reasons)},
    }
    if distill is not None:
        metrics["opd"] = distill_metrics
    return sequences, metrics


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _std(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _log_tensorboard(run_id: int, step: int, metrics: dict, config: dict | None = None) -> None:
    """One scalar per numeric metric (nested dicts flattened with `/`) at global step `step`."""
    log_scalars(run_id, {f"train/{name}": value for name, value in _flatten(metrics)}, step, config)


def _flatten(metrics: dict, prefix: str = ""):
    for key, value in metrics.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield f"{prefix}{key}", float(value)
