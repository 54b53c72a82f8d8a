"""A run's per-step metrics as a table: `GET /api/runs/<id>/metrics?format=json|csv`.

What the run page charts, for a notebook or a spreadsheet: one row per completed training step,
one column per metric the trainer or scheduler recorded (`TrainingStep.metrics`), nested keys
joined with dots (`off_policy.ratio_p50`, `scheduling.ready_wait_s.max`).  A metric a step did not
record is empty in CSV and null in JSON, never 0.  Non-numeric leaves (text, lists) are left out:
the table holds numbers only, and the full record stays in `GET /api/runs/<id>`.
"""
from __future__ import annotations

import csv
import io
import math
from typing import Any

from flask import Blueprint, Response, jsonify, request
from sqlalchemy import select

from app.api.errors import ApiError
from app.db import session_scope
from app.tables import Run, TrainingStep

bp = Blueprint("metrics", __name__)
FORMATS = ("json", "csv")


def flatten(metrics: dict[str, Any] | None, prefix: str = "") -> dict[str, float | None]:
    """{dotted key: float} of the numeric leaves of `metrics`; NaN and infinities become None
    (JSON has no NaN, and a spreadsheet would read them as text).  Bools are not numbers."""
    out: dict[str, float | None] = {}
    for key, value in (metrics or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value) if math.isfinite(value) else None
    return out


def metrics_table(steps: list[TrainingStep]) -> tuple[list[str], list[dict[str, float | None]]]:
    """(columns, rows) of the completed steps, in step order; `columns` starts with "step"."""
    rows, keys = [], set()
    for st in sorted(steps, key=lambda s: s.step):
        if st.status != "completed":
            continue
        flat = flatten(st.metrics)
        keys.update(flat)
        rows.append({"step": st.step, **flat})
    columns = ["step", *sorted(keys - {"step"})]
    return columns, [{c: row.get(c) for c in columns} for row in rows]


@bp.get("/runs/<id:run_id>/metrics")
def run_metrics(run_id: int):
    """JSON {run_id, columns, steps: [{column: value}]} or CSV (header row, one line per step)."""
    fmt = request.args.get("format", "json").strip().lower()
    if fmt not in FORMATS:
        raise ApiError(400, f"format must be one of {', '.join(FORMATS)} (got {fmt!r})", field="format")
    with session_scope() as session:
        if session.get(Run, run_id) is None:
            raise ApiError(404, f"run {run_id} not found")
        steps = list(session.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id)))
        columns, rows = metrics_table(steps)
    if fmt == "json":
        return jsonify({"run_id": run_id, "columns": columns, "steps": rows})
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else (int(v) if k == "step" else repr(v)) for k, v in row.items()})
    return Response(buf.getvalue(), mimetype="text/csv",
                    headers={"Content-Disposition": f'attachment; filename="run-{run_id}-metrics.csv"'})
