"""Experiment tracking: TensorBoard always, Weights & Biases when `TURNSTILE_WANDB_MODE` says so.

One function, `log_scalars`, used by training steps (`train/*` per step) and by the control
loop when a run ends (`<kind>/*`).  TensorBoard events go to `<var_dir>/runs/<id>/tensorboard/`
through TensorBoard's own torch-free writer (`tensorboard.summary.Writer`); W&B runs are
named `turnstile-<run id>` and resumed by that id from any process, with their files under
`<var_dir>/runs/<id>/wandb/` (offline mode needs no network: `wandb sync` uploads later,
https://docs.wandb.ai/guides/technical-faq/setup/#can-i-run-wandb-offline).

Tracking never fails a step or a run: errors are logged and swallowed.
"""
from __future__ import annotations

import logging

from app.config import get_settings
from app.paths import RunPaths

log = logging.getLogger("turnstile.tracking")


def log_scalars(run_id: int, scalars: dict[str, float], step: int, config: dict | None = None) -> None:
    """Log `{tag: value}` at global step `step` to TensorBoard, and to W&B when enabled.

    `config` (the run's config, JSON) is attached to the W&B run.  Values must be finite
    floats; tags use `/` for groups (`train/loss`).
    """
    try:
        from tensorboard.summary import Writer

        writer = Writer(str(RunPaths(run_id).tensorboard))
        try:
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, step=step)
        finally:
            writer.close()
    except Exception:  # noqa: BLE001 - tracking must not fail training
        log.exception("run=%s event=tensorboard_failed", run_id)
    settings = get_settings()
    if settings.wandb_mode != "disabled":
        _log_wandb(run_id, scalars, step, config, settings.wandb_mode, settings.wandb_project)


def _log_wandb(run_id: int, scalars: dict[str, float], step: int, config: dict | None, mode: str,
               project: str) -> None:
    try:
        import wandb

        folder = RunPaths(run_id).root  # W&B writes its files to `<folder>/wandb/`
        folder.mkdir(parents=True, exist_ok=True)
        run = wandb.init(project=project, id=f"turnstile-{run_id}", name=f"run {run_id}", resume="allow",
                         mode=mode, dir=str(folder), config=config or {}, reinit="finish_previous",
                         settings=wandb.Settings(silent=True, console="off"))
        try:
            run.log(dict(scalars), step=step)
        finally:
            run.finish()
    except Exception:  # noqa: BLE001 - tracking must not fail training
        log.exception("run=%s event=wandb_failed", run_id)
