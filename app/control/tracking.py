"""Experiment tracking for every run kind: TensorBoard scalars of a finished run's summary.

Training steps write their own scalars (`train/...`, app.training.steps) as they finish;
this writes the run-level figures when a run ends, so eval and collect runs appear in
TensorBoard too (`make up` serves `var/runs`).  It uses TensorBoard's own torch-free event
writer (`tensorboard.summary.Writer`), so the control worker never imports torch.
"""
from __future__ import annotations

import logging

from app.config import get_settings

log = logging.getLogger("turnstile.tracking")


def run_scalars(kind: str, summary: dict) -> dict[str, float]:
    """{tag: value} of a run summary (`app.control.summary.summarize_run`) for TensorBoard.

    Tags: `<kind>/reward_mean`, `<kind>/resolved_rate`, `<kind>/pass_at_k` (the fraction of
    instances with at least one resolved sample) and `<kind>/instance/<id>/pass_at_k`; None
    values are left out.
    """
    out: dict[str, float] = {}
    for key in ("reward_mean", "resolved_rate"):
        if summary.get(key) is not None:
            out[f"{kind}/{key}"] = float(summary[key])
    per_instance = summary.get("pass_at_k") or {}
    if per_instance:
        out[f"{kind}/pass_at_k"] = sum(1 for v in per_instance.values() if v) / len(per_instance)
        for instance_id, passed in per_instance.items():
            out[f"{kind}/instance/{instance_id}/pass_at_k"] = float(bool(passed))
    return out


def log_run_summary(run_id: int, kind: str, summary: dict, step: int = 0) -> None:
    """Write the run summary's scalars under `<var_dir>/runs/<run_id>/tensorboard/` at `step`.

    Tracking never fails a run: an error writing the events is logged and swallowed.
    """
    from tensorboard.summary import Writer

    try:
        writer = Writer(str(get_settings().var_dir / "runs" / str(run_id) / "tensorboard"))
        try:
            for tag, value in run_scalars(kind, summary).items():
                writer.add_scalar(tag, value, step=step)
        finally:
            writer.close()
    except Exception:  # noqa: BLE001 - a tracking failure must not fail the run
        log.exception("run=%s event=tensorboard_failed", run_id)
