"""Checks a run config against this installation before the run is created.

Kept apart from the pydantic schema because the answers depend on the machine (is the
harness installed? does the task set exist?), not on the request alone.  Imports nothing
heavy (no torch), so the API process runs it on every `POST /api/runs`.
"""
from __future__ import annotations

from app.runconfig import RunConfig

EMBEDDED_MODELS = ("smollm2", "tiny")


def _short(message: str, limit: int = 400) -> str:
    """First lines of a long error (a bad file's records must not be echoed whole)."""
    return message if len(message) <= limit else message[:limit] + " …"


def check_installation(cfg: RunConfig) -> tuple[str, str] | None:
    """`(field, message)` of the first choice the real stages cannot serve here, or None.

    Checks the checkpoint, the task set and its instances, the embedded model and whether
    the harness is installed.
    """
    if cfg.model.checkpoint:
        from app.training.checkpoints import resolve_checkpoint

        try:
            resolve_checkpoint(cfg.model.checkpoint)
        except FileNotFoundError as exc:
            return "model.checkpoint", str(exc)
    from app.tasksets import load_task_set

    try:
        task_set = load_task_set(cfg.task_set)
    except (FileNotFoundError, ValueError) as exc:
        return "task_set", _short(str(exc))
    known = {r.instance_id for r in task_set.instances}
    missing = [name for name in cfg.instances or [] if name not in known]
    if missing:
        return "instances", f"task set {task_set.name!r} has no instance(s) {missing}"
    if cfg.model.engine == "embedded" and cfg.model.name not in EMBEDDED_MODELS:
        return "model.name", (f"the embedded engine serves {' or '.join(EMBEDDED_MODELS)}, not {cfg.model.name!r}; "
                              "use model.engine=vllm with model.engine_urls for other models")
    from app.harnesses import get_preset

    preset = get_preset(cfg.harness)
    if not preset.is_installed():
        return "harness", (
            f"harness {cfg.harness!r} is not installed; run `make harnesses` (or "
            f"`python -m app harness install {cfg.harness}`) first"
        )
    return None
