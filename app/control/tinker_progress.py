"""What a Tinker model's run has done, read from its futures (the one record of its ops): the run
page and `GET /api/runs/<id>` show it for runs of kind `tinker`.

    steps                optim_step futures completed (the model's optimizer updates)
    losses               one point per completed forward_backward: the first `loss...` metric the
                         trainer reported (e.g. "loss:sum") and the optim step it preceded
    sampler_checkpoints  completed save_weights_for_sampler futures: the tinker:// path and when
    checkpoints          completed save_weights (save_state) futures: the path and when
    futures              count by status, and the newest failure's message
"""
from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.tables import TinkerFuture, TinkerModel


def _loss(metrics: dict) -> tuple[str, float] | None:
    for key in sorted(metrics or {}):
        if key.startswith("loss"):
            try:
                return key, float(metrics[key])
            except (TypeError, ValueError):
                return None
    return None


def progress(s: Session, run_id: int) -> dict | None:
    """The Tinker progress of run `run_id`, or None when it is not a Tinker model's run."""
    model = s.scalars(select(TinkerModel).where(TinkerModel.run_id == run_id)).first()
    if model is None:
        return None
    rows = s.execute(select(TinkerFuture.id, TinkerFuture.op, TinkerFuture.result, TinkerFuture.payload,
                            TinkerFuture.finished_at)
                     .where(TinkerFuture.model_id == model.id, TinkerFuture.status == "completed",
                            TinkerFuture.op.in_(("forward_backward", "optim_step", "save_weights",
                                                 "save_weights_for_sampler")))
                     .order_by(TinkerFuture.id)).all()
    steps, losses, samplers, states = 0, [], [], []
    for fid, op, result, payload, finished in rows:
        result = result or {}
        if op == "optim_step":
            steps += 1
        elif op == "forward_backward":
            loss = _loss(result.get("metrics") or {})
            if loss is not None:
                losses.append({"step": steps, "future": fid, "metric": loss[0], "value": loss[1]})
        else:
            entry = {"path": result.get("path") or (payload or {}).get("path"), "future": fid, "after_step": steps,
                     "at": finished.isoformat() if finished else None}
            (samplers if op == "save_weights_for_sampler" else states).append(entry)
    counts = dict(s.execute(select(TinkerFuture.status, func.count()).where(TinkerFuture.model_id == model.id)
                            .group_by(TinkerFuture.status)).all())
    failed = s.execute(select(TinkerFuture.op, TinkerFuture.error).where(
        TinkerFuture.model_id == model.id, TinkerFuture.status == "failed").order_by(TinkerFuture.id.desc())).first()
    return {"model_id": model.id, "base_model": model.base_model, "lora_rank": model.lora_rank,
            "key": model.key_name, "steps": steps, "losses": losses, "sampler_checkpoints": samplers,
            "checkpoints": states, "futures": counts,
            "last_failure": {"op": failed[0], "error": (failed[1] or {}).get("error")} if failed else None}
