"""Dashboard routes.  Each page reads SQL through its module (`data.py` runs, `run_view.py`, `episode.py`,
`compare.py`, `overlay.py`, `engines.py`) and renders one template."""
from __future__ import annotations

from flask import Blueprint, abort, redirect, render_template, request, url_for
from sqlalchemy import select

from app.api.configdiff import config_diff
from app.api.dashboard import compare, data, engines, episode, overlay, run_view
from app.api.dashboard.form import run_config_form
from app.api.labels import RunFilter
from app.config import get_settings
from app.api.openapi import openapi_spec
from app.db import session_scope
from app.tables import RUN_KINDS, RUN_STATES, Run
from app.tensorboard_runs import tensorboard_url
from app.transitions import RUN_CANCELLABLE, TERMINAL

bp = Blueprint("dashboard", __name__, template_folder="templates", static_folder="static",
               static_url_path="/dashboard/static")


def _arg(name: str, choices=None) -> str | None:
    value = (request.args.get(name) or "").strip() or None
    if value is not None and choices is not None and value not in choices:
        abort(400, f"{name}: must be one of {', '.join(choices)}")
    return value


def _int_arg(name: str) -> int | None:
    raw = (request.args.get(name) or "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        abort(400, f"{name}: must be a run id")
    return int(raw)


@bp.app_template_filter("num")
def _num(value, spec: str = ".3f") -> str:
    """Numbers for tables: `-` for missing, fixed precision for floats."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


@bp.get("/")
def runs_page():
    try:
        where = RunFilter.from_args(request.args)  # the same search and filters as GET /api/runs
    except ValueError as exc:
        abort(400, str(exc))
    with session_scope() as s:
        rows = data.runs_overview(s, where)
        state = [{"id": r["id"], "status": r["status"], "policy_version": r["policy_version"],
                  "episodes_by_status": r["by_status"], "name": r["name"], "tags": r["tags"]} for r in rows]
        return render_template("dashboard/runs.html", rows=rows, f=where, state=state, shown=data.RUNS_SHOWN,
                               states=RUN_STATES, kinds=RUN_KINDS, engine_rows=engines.engine_sharing(s),
                               links=monitoring_links())


def monitoring_links() -> dict:
    """TensorBoard's and Flower's addresses from the settings (None where not configured)."""
    settings = get_settings()
    return {"tensorboard": settings.tensorboard_url, "flower": settings.flower_url}


@bp.get("/runs")
def overlay_page():
    """`/runs?compare=1,3`: the runs' per-step curves overlaid; without `compare`, the runs list."""
    raw = request.args.getlist("compare")
    if not raw:
        return redirect(url_for("dashboard.runs_page"))
    try:
        ids = overlay.parse_ids(raw)
    except ValueError as exc:
        abort(400, str(exc))
    if not ids:
        abort(400, "compare: give run ids, e.g. /runs?compare=1,3")
    with session_scope() as s:
        view = overlay.overlay(s, ids)
        if not view["runs"]:
            abort(404, f"run {', '.join(map(str, view['missing']))} not found")
        return render_template("dashboard/overlay.html", v=view)


@bp.get("/runs/<id:run_id>")
def run_page(run_id: int):
    status = _arg("status")
    outcome = _arg("outcome", ("resolved", "unresolved"))
    with session_scope() as s:
        view = run_view.run_detail(s, run_id, status=status, instance=_arg("instance"), outcome=outcome)
        if view is None:
            abort(404, f"run {run_id} not found")
        links = monitoring_links()
        links["run_tensorboard"] = tensorboard_url(links["tensorboard"], run_id, view["run"].kind,
                                                   view["config"].get("harness"), view["run"].name)
        return render_template("dashboard/run.html", v=view, fmt_ci=_ci, links=links, f={"status": status, "instance": _arg("instance"),
                                                                 "outcome": outcome},
                               terminal_states=TERMINAL, cancellable=RUN_CANCELLABLE)


@bp.get("/episodes/<id:episode_id>")
def episode_page(episode_id: int):
    with session_scope() as s:
        view = episode.episode_detail(s, episode_id)
        if view is None:
            abort(404, f"episode {episode_id} not found")
        return render_template("dashboard/episode.html", v=view)


@bp.get("/compare")
def compare_page():
    a, b = _int_arg("a"), _int_arg("b")
    with session_scope() as s:
        evals = s.scalars(select(Run).where(Run.kind == "eval").order_by(Run.id.desc()).limit(200)).all()
        view, refused, diff = None, None, None
        if a is not None and b is not None:
            try:
                force = compare.force_flag(request.args.get("force"))
            except ValueError as exc:
                abort(400, str(exc))
            try:
                view = compare.compare_runs(s, a, b, force=force)
            except compare.NotComparable as exc:
                refused = exc.reasons  # a notice on the page, with a link that forces the comparison
            if view is None and refused is None:
                abort(404, f"run {a if s.get(Run, a) is None else b} not found")
            diff = config_diff(s.get(Run, a).config, s.get(Run, b).config)
        return render_template("dashboard/compare.html", evals=evals, a=a, b=b, v=view, refused=refused, diff=diff,
                               fmt_ci=_ci)


def _ci(interval) -> str:
    """`[0.05, 0.70]` for a (low, high) pair, "" for None."""
    return "" if interval is None else f"[{interval[0]:.2f}, {interval[1]:.2f}]"


@bp.get("/submit")
def submit_page():
    return render_template("dashboard/submit.html", fields=run_config_form(openapi_spec()))
