"""Run-level figures for experiment tracking, written when a run ends.

Training steps log their own scalars (`train/...`, app.training.steps); this logs the run's
final figures, so eval and collect runs appear in TensorBoard (and W&B when enabled) too.
Writing goes through `app.training.tracking`, which never imports torch.
"""
from __future__ import annotations

from app.training.tracking import log_scalars


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


def log_run_summary(run_id: int, kind: str, summary: dict, step: int = 0, config: dict | None = None) -> None:
    """Log the run summary's scalars (`run_scalars`) at `step`; never raises."""
    log_scalars(run_id, run_scalars(kind, summary), step, config)
