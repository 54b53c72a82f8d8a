"""Which train runs may share one deployment's engines and trainer, checked when a run is created.

Train runs with `training.lora` are adapters on one resident base model (`app.training.tenants`):
any number of them share the engines and the trainer when their LoRA shape agrees (base model,
`lora_r`, `lora_alpha`, `lora_target_modules`, adapter dtype).  A full fine-tune writes every
weight the engines serve, so it takes the engines for itself: it is refused while LoRA runs
share them, and a LoRA run is refused while a full fine-tune holds them.

An eval run that loads a checkpoint (`model.checkpoint`) writes the engines' weights as a full
fine-tune does: it is refused while LoRA runs share them, and a LoRA run is refused while it runs.

"Uses the engines": a run in `ACTIVE_STATES` whose stages are real (not simulated) and whose
engine set (`model.engine_urls`, or the installation's `TURNSTILE_ENGINE_URLS`) overlaps this
one's.  Full fine-tunes side by side are still allowed (as before this module): `engine_notice`
words the warning the API returns with such a run.  Imports no torch (the API process runs it).
"""
from __future__ import annotations

from sqlalchemy import select

from app.config import get_settings
from app.db import session_scope
from app.runconfig import RunConfig
from app.tables import Run

ACTIVE_STATES = ("queued", "running", "cancelling")
ADAPTER_DTYPE = "float32"  # the trainer's fp32 master weights (app.training.tenants.ADAPTER_DTYPE)
SHAPE_FIELDS = {"model": "model.name", "lora_r": "training.lora_r", "lora_alpha": "training.lora_alpha",
                "lora_target_modules": "training.lora_target_modules", "dtype": "training.lora_dtype"}


def lora_shape(cfg: RunConfig) -> dict:
    """The fields a LoRA run must share with the pool: base weights, rank, alpha, targets, dtype."""
    t = cfg.training
    return {"model": cfg.model.checkpoint or cfg.model.name, "lora_r": t.lora_r, "lora_alpha": t.lora_alpha,
            "lora_target_modules": tuple(t.lora_target_modules), "dtype": ADAPTER_DTYPE}


def _engines(cfg: RunConfig) -> set[str]:
    return set(cfg.model.engine_urls or get_settings().engine_urls)


def engine_problems(cfg: RunConfig, exclude_run: int | None = None) -> list[tuple[str, str]]:
    """`(field, message)` for each reason a new run `cfg` cannot share the deployment with the runs
    already using its engines; [] when it can (or `cfg` is simulated, or an eval run that loads
    no checkpoint).
    Sharing needs one engine kind for all (embedded, or vLLM with `--enable-lora`: both serve each
    run's adapter per request) and, for embedded engines, the trainer's disk.
    `exclude_run`: a run id left out (the run itself, when re-checked)."""
    if cfg.simulate is not None or cfg.kind not in ("train", "eval"):
        return []
    if cfg.kind == "eval":
        return _checkpoint_eval_problems(cfg, exclude_run)
    mine = _engines(cfg)
    others = _users(cfg, "train", exclude_run)
    evals = [rid for rid, other in _users(cfg, "eval", exclude_run) if other.model.checkpoint]
    if cfg.training.lora and evals:
        return [("training.lora", f"true: eval run {evals[0]} has loaded a checkpoint into these engines, so the base "
                                  "weights LoRA adapters sit on are not the base model's now; wait until it ends")]
    if not others:
        return []
    full = [rid for rid, other in others if not other.training.lora]
    if not cfg.training.lora:
        lora = [rid for rid, other in others if other.training.lora]
        if not lora:
            return []  # full fine-tunes side by side: as before, told in `engine_notice`
        ids = ", ".join(str(rid) for rid in lora)
        return [("training.lora", f"false: a full fine-tune takes the engines for itself, and LoRA train run(s) {ids} "
                                  "share them now (its weights would replace their base); wait until they end, or "
                                  "train LoRA adapters (training.lora: true)")]
    if full:
        return [("training.lora", f"true: train run {full[0]} is a full fine-tune and holds the engines for itself; "
                                  "LoRA runs share them only with other LoRA runs. Wait until it ends")]
    holder_id, holder = others[0]
    if cfg.model.engine != holder.model.engine:
        return [("model.engine", f"{cfg.model.engine!r}: train run {holder_id} serves its LoRA adapter on these "
                                 f"engines as {holder.model.engine!r} engines; use the same engine kind, or wait until "
                                 "it ends")]
    from app.training.weight_sync import pushes_to  # no torch

    # vLLM reads every adapter by path; an embedded engine on another machine gets full weights.
    if cfg.model.engine == "embedded" and any(pushes_to(u) for u in mine | _engines(holder)):
        return [("model.engine_urls", "LoRA runs share engines only on this machine's disk (the trainer's adapter "
                                      f"folders are read by path); train run {holder_id} uses these engines, which "
                                      "get checkpoints over HTTP. Wait until it ends")]
    shape = lora_shape(cfg)
    pool = lora_shape(holder)
    out = []
    for attr, where in SHAPE_FIELDS.items():
        if shape[attr] != pool[attr]:
            out.append((where, f"{_show(shape[attr])} cannot share the LoRA pool of train run {holder_id}, whose "
                               f"adapters have {_show(pool[attr])}; use the same value, or wait until it ends"))
    return out


def _kinds(kind: str) -> tuple[str, ...]:
    """A Tinker model's run is a LoRA tenant as a LoRA train run is: it shares the engines as one."""
    return ("train", "tinker") if kind == "train" else (kind,)


def _users(cfg: RunConfig, kind: str, exclude_run: int | None) -> list[tuple[int, RunConfig]]:
    """(id, config) of the active real runs of `kind` whose engines overlap `cfg`'s, oldest first."""
    mine = _engines(cfg)
    with session_scope() as s:
        rows = [(r.id, r.run_config()) for r in s.scalars(
            select(Run).where(Run.status.in_(ACTIVE_STATES), Run.kind.in_(_kinds(kind))).order_by(Run.id))
            if r.id != exclude_run]
    return [(rid, other) for rid, other in rows
            if other.simulate is None and (mine == _engines(other) or mine & _engines(other))]


def _checkpoint_eval_problems(cfg: RunConfig, exclude_run: int | None) -> list[tuple[str, str]]:
    """An eval run that loads `model.checkpoint` pushes full weights into its engines: refused while
    LoRA train runs share them (it would replace the base their adapters sit on)."""
    if not cfg.model.checkpoint:
        return []  # it samples the engines as they are; it loads nothing
    lora = [rid for rid, other in _users(cfg, "train", exclude_run) if other.training.lora]
    if not lora:
        return []
    ids = ", ".join(map(str, lora))
    return [("model.checkpoint", f"{cfg.model.checkpoint!r}: loading it replaces the base weights that LoRA train "
                                 f"run(s) {ids} share on these engines; wait until they end, or evaluate on other "
                                 "engines (model.engine_urls)")]


def engine_notice(cfg: RunConfig, exclude_run: int | None = None) -> dict | None:
    """For a full fine-tune created while other full fine-tunes use its engines (allowed, as
    before): `{"engines_held_by_runs": [ids], "message"}` for the API's answer; else None.
    `exclude_run`: the run itself."""
    if cfg.kind != "train" or cfg.simulate is not None or cfg.training.lora:
        return None
    ids = [rid for rid, _other in _users(cfg, "train", exclude_run)]
    if not ids:
        return None
    return {"engines_held_by_runs": ids,
            "message": f"train run(s) {', '.join(map(str, ids))} use these engines: a full fine-tune takes them for "
                       "itself, so each run's new weights replace the other's on the engines. Train LoRA adapters "
                       "(training.lora: true) to share them, or wait until those runs end"}


def _show(value) -> str:
    return ", ".join(value) if isinstance(value, tuple) else repr(value)
