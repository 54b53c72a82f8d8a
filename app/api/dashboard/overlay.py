"""Several runs on one set of charts (`/runs?compare=1,3`): each per-step curve of the run page
(`charts.CHARTS`), one line per run, every run named by kind, harness, model and task set in the
page's table (its colour beside it), and by its id in each chart's legend.

A chart here carries one series per run: that run's value of the chart's first series (the
reward mean, the loss, the step time, ...), aligned on the union of the runs' completed steps,
None where a run has no such step or did not compute the metric (the browser shows
"not computed", never 0).  The y axis stays [0, 1] for rates and rewards only when every run's
chart is pinned there.
"""
from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.api.dashboard.charts import CHARTS, step_charts
from app.tables import Run, TrainingStep

MAX_RUNS = 8  # one colour each in the page's palette, and a legend that stays readable


def run_label(run: Run) -> str:
    """`#3 train · mini-swe-agent · smollm2 · starter`: what tells one overlaid line from another."""
    cfg = run.config or {}
    model = cfg.get("model") or {}
    return (f"#{run.id} {run.kind} · {cfg.get('harness') or '-'} · {model.get('checkpoint') or model.get('name') or '-'}"
            f" · {cfg.get('task_set') or '-'}")


def parse_ids(values: list[str]) -> list[int]:
    """Run ids of `compare=1,3` (also repeated: `compare=1&compare=3`), ascending, once each (so a
    run gets the same line colour however the page was asked for).

    Raises ValueError naming the bad part, or when more than `MAX_RUNS` ids are given.
    """
    ids: list[int] = []
    for value in values:
        for part in value.split(","):
            part = part.strip().removeprefix("#")
            if not part:
                continue
            if not part.isdigit():
                raise ValueError(f"compare: {part[:40]!r} is not a run id")
            if int(part) not in ids:
                ids.append(int(part))
    if len(ids) > MAX_RUNS:
        raise ValueError(f"compare: at most {MAX_RUNS} runs on one page, got {len(ids)}")
    return sorted(ids)


def overlay(s: Session, run_ids: list[int]) -> dict:
    """{runs: [{id, label, kind, status, steps}], missing: [ids], charts: [chart]} for the runs that exist."""
    runs, missing = [], []
    for run_id in run_ids:
        run = s.get(Run, run_id)
        if run is None:
            missing.append(run_id)
        else:
            runs.append(run)
    per_run = []
    for run in runs:
        steps = s.scalars(select(TrainingStep).where(TrainingStep.run_id == run.id).order_by(TrainingStep.step)).all()
        charts, _missing = step_charts(steps, run.config or {})
        per_run.append((run, {c["id"]: c for c in charts}, sum(1 for st in steps if st.status == "completed")))
    x = sorted({step for _run, charts, _n in per_run for c in charts.values() for step in c["x"]})
    out = []
    for index, (title, _spec, _opts) in enumerate(CHARTS):
        chart_id = f"chart-{index}"
        series, pinned, reasons = [], True, []
        for position, (run, charts, _n) in enumerate(per_run):
            c = charts.get(chart_id)
            if c is None:
                continue
            first = c["series"][0]
            by_step = dict(zip(c["x"], first["values"]))
            # short in the chart's legend: the page's table above names each run in full, in its colour
            series.append({"label": f"#{run.id} {first['label']}", "values": [by_step.get(step) for step in x],
                           "colour": position})  # a run keeps its colour on every chart
            pinned = pinned and c["range"] is not None
            if c["not_computed"]:
                reasons.append(f"#{run.id}: {c['not_computed']}")
        if not series:
            continue
        empty = all(v is None for ser in series for v in ser["values"])
        out.append({"id": chart_id, "title": title, "x": x, "series": series, "band": False,
                    "range": [0.0, 1.0] if pinned else None,
                    "not_computed": "; ".join(reasons) if empty else None})
    return {"runs": [{"id": run.id, "label": run_label(run), "kind": run.kind, "status": run.status, "steps": n}
                     for run, _charts, n in per_run],
            "missing": missing, "charts": out}
