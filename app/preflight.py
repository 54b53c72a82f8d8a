"""Checks a run config against this installation before the run is created.

Returns `(field, message)` for the first problem, or None.  Kept apart from the
pydantic schema because the answers depend on the machine (is the harness
installed? does the task set exist?), not on the request alone.
"""
from __future__ import annotations

from app.runconfig import RunConfig


def check_run_config(cfg: RunConfig) -> tuple[str, str] | None:
    if cfg.simulate is not None:
        return None  # simulated runs use no harness, task files or engine
    if cfg.model.checkpoint:
        from app.scheduler import resolve_checkpoint

        try:
            resolve_checkpoint(cfg.model.checkpoint)
        except FileNotFoundError as exc:
            return "model.checkpoint", str(exc)
    try:
        from app.tasksets import resolve_task_set
    except ImportError:  # pragma: no cover - task sets not built yet
        return None
    try:
        resolve_task_set(cfg.task_set)
    except (FileNotFoundError, ValueError) as exc:
        return "task_set", str(exc)
    try:
        from app.harnesses import get_preset
    except ImportError:  # pragma: no cover
        return None
    preset = get_preset(cfg.harness)
    if not preset.is_installed():
        return "harness", (
            f"harness {cfg.harness!r} is not installed; run `make harnesses` (or "
            f"`python -m app harness install {cfg.harness}`) first"
        )
    return None
