"""Put restarted engines back on the weights their runs sample from (a watchdog duty).

An engine that restarts loads the weights it was started with and stamps policy version 0 on
what it serves.  A run that goes on sampling from it would then train on (or evaluate) answers
of a policy it never asked for, every one stamped with a plausible version.  Three things a run
can need from an engine, each checked the cheapest way the engine allows:

* a full-weights train run with a completed step: the newest step's checkpoint.  A restarted
  engine serves a version below it, so the version tells;
* a run that started from a checkpoint (`model.checkpoint`: a warm start, or an eval of a trained
  policy) and has no full-weights step yet: that checkpoint.  Its version cannot tell (a train
  run numbers the checkpoint it starts from 0, as the base model is 0), so the engine's weights
  name tells (`GET /v1/policy_version` `weights`, `app.engines.client.weights_label`).  This is
  also the base under a warm-started LoRA run's adapter, reloaded before the adapter;
* a LoRA run's newest adapter: a restarted engine no longer lists it.

A held-out eval of a train run (`eval_of`) that loaded nothing itself samples the engines as that
train run keeps them, so it asks for what the train run needs, also after the train run ended
(its final eval).  vLLM names no weights and has no `/v1/policy_version`: a vLLM engine's starting
checkpoint is not checked, and a full-weights run's version check reports an error for it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select

from app.config import get_settings
from app.db import session_scope
from app.tables import Run, TrainingStep

log = logging.getLogger("turnstile.watchdog")


@dataclass(frozen=True)
class Needs:
    """What one run needs its engines to serve.

    `start`: (model folder, policy version) of the checkpoint the run started from, or None (the
    engines' own base).  `step`: (policy version, checkpoint folder, LoRA adapter name or None)
    of the newest completed step, or None before the first.
    """

    run_id: int
    urls: tuple[str, ...]
    engine: str
    start: tuple[Path, int] | None
    step: tuple[int, Path, str | None] | None

    @property
    def full_weights_step(self) -> bool:
        """A completed step that pushed full weights (no adapter): it, not the start, is served."""
        return self.step is not None and not self.step[2]


def resync_engines() -> dict[str, str]:
    """Re-sync every engine of every running run (module docstring).

    Returns `{engine_url: "ok" | "error: …"}` for each engine it loaded weights or an adapter into,
    or could not reach or check (an error is kept over a later "ok" for the same engine); `{}`
    when every engine already serves what its runs need.  Engine failures are reported there,
    never raised; a database or Redis error propagates to the watchdog pass.
    """
    results: dict[str, str] = {}
    needs = running_needs()
    starts: dict[str, set[Path]] = {}
    for need in needs:
        if need.start is not None and not need.full_weights_step:
            for url in need.urls:
                starts.setdefault(url, set()).add(need.start[0])
    for need in needs:
        for url in need.urls:
            conflict = len(starts.get(url, ())) > 1
            if conflict and need.start is not None and not need.full_weights_step:
                # Runs sharing this engine want different starting checkpoints: loading them would
                # flip it on every pass.  Their steps and adapters are still re-synced.
                log.warning("run=%s engine=%s event=resync_conflict starts=%s", need.run_id, url,
                            sorted(map(str, starts[url])))
            for engine_url, result in _resync(url, need, load_start=not conflict).items():
                if not results.get(engine_url, "").startswith("error"):
                    results[engine_url] = result
    return results


def running_needs() -> list[Needs]:
    """`Needs` of every running run: its own, or for an `eval_of` eval that loaded no checkpoint, its
    train run's (the train run may have ended: the final eval still samples its policy).  A run
    whose stored config no longer validates is logged and skipped, not allowed to stop the pass."""
    with session_scope() as s:
        running = s.execute(select(Run).where(Run.status == "running").order_by(Run.id)).scalars().all()
        wanted: dict[int, None] = {}  # run ids in order, each once
        for run in running:
            cfg = _config(run)
            if cfg is not None:
                own = cfg.eval_of is None or run.start_weights() is not None
                wanted[run.id if own else cfg.eval_of.run] = None
        out = []
        for run_id in wanted:
            run = s.get(Run, run_id)
            cfg = _config(run) if run is not None else None
            if cfg is None:
                continue
            start = run.start_weights()
            step = s.execute(
                select(TrainingStep).where(TrainingStep.run_id == run_id, TrainingStep.status == "completed",
                                           TrainingStep.checkpoint_path.is_not(None))
                .order_by(TrainingStep.step.desc()).limit(1)).scalar_one_or_none()
            out.append(Needs(
                run_id, tuple(cfg.model.engine_urls or get_settings().engine_urls), cfg.model.engine,
                (Path(start[0]), start[1]) if start else None,
                (step.policy_version, Path(step.checkpoint_path), (step.metrics or {}).get("adapter")) if step else None))
        return out


def _config(run: Run):
    """The run's `RunConfig`, or None (logged) when its stored config no longer validates."""
    from pydantic import ValidationError

    try:
        return run.run_config()
    except ValidationError as exc:
        log.error("run=%s event=resync_skipped bad stored config: %s", run.id, exc)
        return None


def _resync(url: str, need: Needs, load_start: bool = True) -> dict[str, str]:
    """What `need` asks of engine `url`, in order: a full-weights step's checkpoint (which replaces
    the start), else the run's starting checkpoint (unless `load_start` is False) and then its
    newest LoRA adapter.  An adapter is not loaded on an engine whose base could not be put right:
    it would be sampled as the run's policy without being it."""
    if need.full_weights_step:
        version, checkpoint, _ = need.step
        return _resync_version(url, need, checkpoint / "model", version)
    done: dict[str, str] = {}
    if need.start is not None and load_start:
        done = _resync_start(url, need)
        if any(r != "ok" for r in done.values()):
            return done
    if need.step is not None:
        version, checkpoint, adapter = need.step
        done.update(_resync_adapter(url, need, adapter, checkpoint, version))
    return done


def _resync_version(url: str, need: Needs, folder: Path, version: int) -> dict[str, str]:
    """Push `folder` as `version` unless the engine serves that version or a newer one."""
    from app.engines.client import EngineCallError, EngineClient
    from app.training.weight_sync import push_weights

    try:
        with EngineClient(url, timeout=10) as client:
            serving = client.policy_version()
    except (EngineCallError, ValueError, KeyError, TypeError) as exc:
        return {url: f"error: {exc}"}
    if serving >= version:
        return {}
    log.warning("run=%s engine=%s event=resync serving=%s policy_version=%s", need.run_id, url, serving, version)
    return push_weights([url], folder, version, engine_kind=need.engine)


def _resync_start(url: str, need: Needs) -> dict[str, str]:
    """Push the run's starting checkpoint unless the engine names it as what it serves."""
    from app.training.weight_sync import ensure_weights

    folder, version = need.start
    done = ensure_weights([url], folder, version, engine_kind=need.engine)
    if done:
        log.warning("run=%s engine=%s event=resync_start checkpoint=%s result=%s", need.run_id, url, folder, done[url])
    return done


def _resync_adapter(url: str, need: Needs, adapter: str, checkpoint: Path, version: int) -> dict[str, str]:
    """Load LoRA adapter `adapter` (from `checkpoint`/adapter) unless the engine serves it
    (`GET /v1/lora_adapters` of an embedded engine, `GET /v1/models` of vLLM)."""
    import httpx

    from app.engines.client import EngineCallError, EngineClient
    from app.engines.vllm.lora import served_adapters
    from app.training.weight_sync import push_adapter

    try:
        if need.engine == "vllm":
            with EngineClient(url, timeout=10) as client:
                served = set(served_adapters(client))
        else:
            served = {a.get("id") for a in httpx.get(f"{url.rstrip('/')}/v1/lora_adapters", timeout=10).json()["data"]}
    except (EngineCallError, httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        return {url: f"error: {exc}"}
    if adapter in served:
        return {}
    log.warning("run=%s engine=%s event=resync_adapter adapter=%s policy_version=%s", need.run_id, url, adapter, version)
    return push_adapter([url], checkpoint / "adapter", adapter, version, engine_kind=need.engine)
