"""The run page's held-out curve: `eval_every` evals of a train run beside its training reward.

`heldout_view` gives {"rows": the curve's points (`app.control.heldout.curve`), "chart": one
chart in the `charts.py` shape or None}.  The chart's x axis is the policy step: held-out pass@1
at the step its eval was made, its 95% interval as a band (series 2 and 3), and the training
reward of each completed step (the mean over its trained episodes, as the reward chart), None where a series
has no value at that step.
"""
from __future__ import annotations

from sqlalchemy.orm import Session

from app.api.dashboard.charts import RATE, metric
from app.tables import Run, TrainingStep


def heldout_view(s: Session, run: Run, steps: list[TrainingStep]) -> dict | None:
    """The held-out rows and chart of train run `run`; None for a run without `eval_every`."""
    if run.kind != "train" or not (run.config or {}).get("eval_every"):
        return None
    from app.control.heldout import curve

    rows = curve(s, run)
    reward = {}
    for st in steps:
        if st.status == "completed":
            reward[st.step] = metric(st.metrics, "reward_mean")
    done = {r["step"]: r for r in rows if r["pass_at_1"] is not None}
    chart = None
    if done:
        x = sorted(set(done) | set(reward))
        chart = {"id": "chart-heldout", "title": "held-out pass@1 (95% CI) and training reward", "x": x,
                 "series": [{"label": "held-out pass@1", "values": [done[v]["pass_at_1"] if v in done else None for v in x]},
                            {"label": "95% low", "values": [done[v]["low"] if v in done else None for v in x]},
                            {"label": "95% high", "values": [done[v]["high"] if v in done else None for v in x]},
                            {"label": "training reward", "values": [reward.get(v) for v in x], "colour": 3}],
                 "band": True, "range": list(RATE), "not_computed": None}
    return {"rows": rows, "chart": chart}
