"""Experiment tracking: TensorBoard always, Weights & Biases when `TURNSTILE_WANDB_MODE` says so.

One function, `log_scalars`, used by training steps (`train/*` per step) and by the control
loop when a run ends (`<kind>/*`).  TensorBoard events go to `<var_dir>/runs/<id>/tensorboard/`
through TensorBoard's own torch-free writer (`tensorboard.summary.Writer`), and TensorBoard lists
them as `<id>-<kind>-<harness>` or `<id>-<name>` (`app.tensorboard_runs`: a link per run); W&B runs
have the same display name, the id `turnstile-<run id>`, and are resumed by that id from any process, with their files under
`<var_dir>/runs/<id>/wandb/` (offline mode needs no network: `wandb sync` uploads later,
https://docs.wandb.ai/guides/technical-faq/setup/#can-i-run-wandb-offline).

Tracking never fails a step or a run: errors are logged and swallowed.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from app.config import get_settings
from app.paths import RunPaths
from app.tensorboard_runs import link_run, run_name

log = logging.getLogger("turnstile.tracking")


def log_scalars(run_id: int, scalars: dict[str, float], step: int, config: dict | None = None) -> None:
    """Log `{tag: value}` at global step `step` to TensorBoard, and to W&B when enabled.

    `config` (the run's config, JSON) is attached to the W&B run.  Values must be finite
    floats; tags use `/` for groups (`train/loss`).
    """
    labels = _run_labels(run_id)
    try:
        _write_events(run_id, scalars, step)
        link_run(run_id, *labels)
    except Exception:  # noqa: BLE001 - tracking must not fail training
        log.exception("run=%s event=tensorboard_failed", run_id)
    settings = get_settings()
    if settings.wandb_mode != "disabled":
        _log_wandb(run_id, scalars, step, config, settings.wandb_mode, settings.wandb_project,
                   run_name(run_id, *labels))


def _run_labels(run_id: int) -> tuple[str | None, str | None, str | None]:
    """(kind, harness, name) of the run in the database, or Nones when it cannot be read (the
    TensorBoard run is then named `<id>` until a later write finds the run)."""
    try:
        from app.db import session_scope
        from app.tables import Run

        with session_scope() as s:
            run = s.get(Run, run_id)
            if run is None:
                return None, None, None
            return run.kind, (run.config or {}).get("harness"), run.name
    except Exception:  # noqa: BLE001 - tracking must not fail training
        log.warning("run=%s event=tracking_run_unreadable", run_id, exc_info=True)
        return None, None, None


def _write_events(run_id: int, scalars: dict[str, float], step: int) -> None:
    """Write one event file of `scalars` into the run's `tensorboard/` folder, whole or not at all.

    TensorBoard reads every `*tfevents*` file under its logdir (`<var_dir>/runs`) as soon as it
    appears, and its writer creates the file before the first record: a full disk left a 0-byte
    (or cut) event file there.  The file is written and fsynced in `<var_dir>/tmp/` (the same
    file system, outside the logdir) and renamed in only when complete.  Raises the `OSError` of
    the write (ENOSPC, ...) after removing the staging folder.
    """
    from tensorboard.summary import Writer

    settings = get_settings()
    final = RunPaths(run_id).tensorboard
    staging_root = Path(settings.var_dir) / "tmp"
    staging_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"tensorboard-{run_id}-", dir=staging_root))
    try:
        writer = Writer(str(staging))
        try:
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, step=step)
        finally:
            writer.close()
        final.mkdir(parents=True, exist_ok=True)
        for event_file in staging.iterdir():
            with open(event_file, "rb") as handle:
                os.fsync(handle.fileno())
            os.rename(event_file, final / event_file.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _log_wandb(run_id: int, scalars: dict[str, float], step: int, config: dict | None, mode: str,
               project: str, name: str) -> None:
    try:
        import wandb

        folder = RunPaths(run_id).root  # W&B writes its files to `<folder>/wandb/`
        folder.mkdir(parents=True, exist_ok=True)
        run = wandb.init(project=project, id=f"turnstile-{run_id}", name=name, resume="allow",
                         mode=mode, dir=str(folder), config=config or {}, reinit="finish_previous",
                         settings=wandb.Settings(silent=True, console="off"))
        try:
            run.log(dict(scalars), step=step)
        finally:
            run.finish()
    except Exception:  # noqa: BLE001 - tracking must not fail training
        log.exception("run=%s event=wandb_failed", run_id)
