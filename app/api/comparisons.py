"""REST endpoints that put two runs side by side: `GET /api/compare` (pass@1 of two eval runs) and
`GET /api/runs/<a>/diff/<b>` (their config diff), documented in app/api/openapi.py.

The comparison is decided by `app.api.dashboard.compare.comparability`, the same function the
compare page and `turnstile compare` go through: a pair it refuses is a 400 naming every
mismatch (`details`), unless `force=1`, and then each mismatch is in `warnings`.
"""
from __future__ import annotations

from flask import Blueprint, jsonify, request

from app.api.configdiff import config_diff
from app.api.dashboard.compare import NotComparable, compare_runs
from app.api.errors import ApiError, query_flag
from app.db import session_scope
from app.tables import Run

bp = Blueprint("comparisons", __name__)


def _run_arg(name: str) -> int:
    raw = (request.args.get(name) or "").strip()
    if not raw.isdigit() or not 1 <= int(raw) < 2**31:
        raise ApiError(400, f"{name}: give a run id, e.g. /api/compare?a=1&b=3", name)
    return int(raw)


def _missing(s, *ids: int) -> ApiError | None:
    gone = [i for i in ids if s.get(Run, i) is None]
    return ApiError(404, f"run {gone[0]} not found") if gone else None


@bp.get("/compare")
def compare():
    a, b = _run_arg("a"), _run_arg("b")
    force = query_flag("force")
    with session_scope() as s:
        if (err := _missing(s, a, b)) is not None:
            raise err
        try:
            view = compare_runs(s, a, b, force=force)
        except NotComparable as exc:
            raise ApiError(400, f"{exc}; add force=1 to compare them anyway", None,
                           [{"message": r} for r in exc.reasons]) from None
        view["runs"] = [{"id": r.id, "kind": r.kind, "status": r.status, "config": r.config} for r in view["runs"]]
        return jsonify(view)


@bp.get("/runs/<id:a>/diff/<id:b>")
def diff(a: int, b: int):
    with session_scope() as s:
        if (err := _missing(s, a, b)) is not None:
            raise err
        ra, rb = s.get(Run, a), s.get(Run, b)
        return jsonify({"a": a, "b": b, "diff": config_diff(ra.config, rb.config)})
