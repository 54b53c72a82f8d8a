"""Run-level figures for experiment tracking, written when a run ends.

Training steps log their own scalars (`train/...`, app.training.steps); this logs the run's
final figures, so eval and collect runs appear in TensorBoard (and W&B when enabled) too.
Writing goes through `app.training.tracking`, which never imports torch.
"""
from __future__ import annotations

from app.training.tracking import log_scalars


def run_scalars(kind: str, summary: dict) -> dict[str, float]:
    """{tag: value} of a run summary (`app.control.summary.summarize_run`) for TensorBoard.

    Tags: `<kind>/reward_mean`, `<kind>/resolved_rate`, `<kind>/solved_fraction` (the fraction
    of instances with at least one resolved sample) and `<kind>/instance/<id>/solved` (1 or 0);
    None values are left out.
    """
    out: dict[str, float] = {}
    for key in ("reward_mean", "resolved_rate"):
        if summary.get(key) is not None:
            out[f"{kind}/{key}"] = float(summary[key])
    per_instance = summary.get("solved") or {}
    if per_instance:
        out[f"{kind}/solved_fraction"] = sum(1 for v in per_instance.values() if v) / len(per_instance)
        for instance_id, solved in per_instance.items():
            out[f"{kind}/instance/{instance_id}/solved"] = float(bool(solved))
    return out


def log_run_summary(run_id: int, kind: str, summary: dict, step: int = 0, config: dict | None = None) -> None:
    """Log the run summary's scalars (`run_scalars`) at `step`; never raises."""
    log_scalars(run_id, run_scalars(kind, summary), step, config)
