"""A run's name, tags and notes: what a person calls a run, checked here, set at submit or later.

They are not run options (nothing in the pipeline reads them), so they live in their own columns
(`Run.name`, `Run.tags`, `Run.notes`) and can change at any time, also on a finished run.

    POST /api/runs             body fields `name`, `tags`, `notes` next to the run options
    PATCH /api/runs/<id>       `name`, `notes` (null or "" clears), `tags` (replaces all), or
                               `add_tags` / `remove_tags`; 400 names every problem at once
    GET /api/runs?q=&tag=&kind=&status=     (`RunFilter`, the runs page uses the same)

A tag is lowercase ASCII, `[a-z0-9][a-z0-9_.:+=-]*`, at most 64 characters: it is used in URLs,
on the command line and in the comma-separated page field, and matched exactly in SQL as `"tag"`
inside the stored JSON text (so no character of a tag may need JSON escaping).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from flask import Blueprint, jsonify, request
from sqlalchemy import Text, cast, func, or_, update

from app.api.errors import ApiError
from app.api.problems import did_you_mean, received
from app.api.serialize import run_to_dict
from app.db import session_scope
from app.tables import RUN_KINDS, RUN_STATES, Run
from app.text import text_problem

bp = Blueprint("labels", __name__)

NAME_MAX, NOTES_MAX, TAG_MAX, TAGS_MAX = 200, 10_000, 64, 32
TAG = re.compile(r"^[a-z0-9][a-z0-9_.:+=-]*$")
LABEL_FIELDS = ("name", "tags", "notes")  # what POST /api/runs takes besides the run options
PATCH_FIELDS = ("name", "tags", "add_tags", "remove_tags", "notes")


def _text(value, field_name: str, limit: int, one_line: bool) -> tuple[str | None, str | None]:
    """(cleaned text or None to clear, problem or None)."""
    if value is None:
        return None, None
    if not isinstance(value, str):
        return None, f"must be a string or null; {received(value)}"
    value = value.strip()
    problem = text_problem(value)
    if problem:
        return None, problem
    if one_line and any(ch in value for ch in "\r\n\t"):
        return None, "must be one line (no newline or tab)"
    if len(value) > limit:
        return None, f"must be at most {limit} characters (got {len(value)})"
    return value or None, None


def _tags(value, field_name: str) -> tuple[list[str], list[dict]]:
    """The tags of `value` (a list of strings), lowercased and deduplicated, and their problems."""
    if not isinstance(value, list):
        return [], [{"field": field_name, "message": f"must be a list of tags, e.g. [\"baseline\"]; {received(value)}"}]
    out, problems = [], []
    for i, tag in enumerate(value):
        where = f"{field_name}.{i}"
        if not isinstance(tag, str):
            problems.append({"field": where, "message": f"must be a string; {received(tag)}"})
            continue
        tag = tag.strip().lower()
        if len(tag) > TAG_MAX:
            problems.append({"field": where, "message": f"must be at most {TAG_MAX} characters (got {len(tag)})"})
        elif not TAG.match(tag):
            problems.append({"field": where, "message": f"{tag!r} is not a tag: letters, digits and _ . : + = - "
                                                        "only, starting with a letter or digit"})
        elif tag not in out:
            out.append(tag)
    return out, problems


def labels_problems(body: dict, allowed: tuple[str, ...]) -> tuple[dict, list[dict]]:
    """The label fields of `body` that are in `allowed`, checked: ({column: value}, problems).

    Values: `name`/`notes` a string (trimmed; "" becomes None) or None; tag lists lowercased and
    deduplicated.  Problems are `{"field", "message"}` dicts, every one at once.
    """
    out: dict = {}
    problems: list[dict] = []
    for key, limit, one_line in (("name", NAME_MAX, True), ("notes", NOTES_MAX, False)):
        if key in allowed and key in body:
            value, problem = _text(body[key], key, limit, one_line)
            if problem:
                problems.append({"field": key, "message": problem})
            else:
                out[key] = value
    for key in ("tags", "add_tags", "remove_tags"):
        if key in allowed and key in body:
            tags, bad = _tags(body[key], key)
            problems += bad
            if len(tags) > TAGS_MAX:
                problems.append({"field": key, "message": f"at most {TAGS_MAX} tags (got {len(tags)})"})
            if not bad:
                out[key] = tags
    return out, problems


def apply_tags(current: list[str] | None, change: dict) -> list[str]:
    """The tags after a change: `tags` replaces them; `add_tags`, then `remove_tags` edit them; sorted."""
    tags = set(change["tags"]) if "tags" in change else set(current or [])
    tags |= set(change.get("add_tags") or [])
    tags -= set(change.get("remove_tags") or [])
    return sorted(tags)


@bp.patch("/runs/<id:run_id>")
def patch_run(run_id: int):
    """Set, change or clear a run's name, tags and notes; answers the run (200), 400 for a bad body."""
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object, e.g. {\"name\": \"baseline\", \"add_tags\": [\"lr-1e-5\"]}")
    unknown = [k for k in body if k not in PATCH_FIELDS]
    problems = [{"field": k, "message": f"unknown field{did_you_mean(k, list(PATCH_FIELDS))}"} for k in unknown]
    change, bad = labels_problems(body, PATCH_FIELDS)
    problems += bad
    if "tags" in body and ("add_tags" in body or "remove_tags" in body):
        problems.append({"field": "tags", "message": "tags replaces every tag: give it alone, or add_tags / remove_tags"})
    if not body:
        problems.append({"field": None, "message": "nothing to change: give name, tags, add_tags, remove_tags or notes"})
    if problems:
        first = problems[0]
        where = f"{first['field']}: " if first["field"] else ""
        raise ApiError(400, f"invalid run labels: {where}{first['message']}", first["field"], problems)
    with session_scope() as session:
        run = session.get(Run, run_id)
        if run is None:
            raise ApiError(404, f"run {run_id} not found")
        values = {k: change[k] for k in ("name", "notes") if k in change}
        if {"tags", "add_tags", "remove_tags"} & change.keys():
            values["tags"] = apply_tags(run.tags, change) or None
        # `updated_at` is kept: it dates the run's last state change (a cancel request's wait is
        # measured from it, app.api.serialize.waiting_reason), and a label is no state change.
        session.execute(update(Run).where(Run.id == run_id).values(**values, updated_at=Run.updated_at))
        session.commit()
        run = session.get(Run, run_id, populate_existing=True)
        from app.tensorboard_runs import link_run  # the TensorBoard run follows a new name

        link_run(run.id, run.kind, (run.config or {}).get("harness"), run.name)
        return jsonify(run_to_dict(run))


# --- search and filter ------------------------------------------------------------------


@dataclass
class RunFilter:
    """Which runs a list shows: text `q` (in name, notes or tags, any case), every tag of `tags`,
    one `kind`, one `status`.  `from_args` reads and checks query arguments."""

    q: str | None = None
    tags: list[str] = field(default_factory=list)
    kind: str | None = None
    status: str | None = None

    @classmethod
    def from_args(cls, args) -> "RunFilter":
        """From a request's query arguments (`q`, `tag` repeated or comma-separated, `kind`, `status`);
        raises `ValueError` naming the argument and what it must be."""
        q = (args.get("q") or "").strip() or None
        if q is not None and (len(q) > NAME_MAX or text_problem(q)):
            raise ValueError(f"q: must be text of at most {NAME_MAX} characters")
        raw = [part for value in args.getlist("tag") for part in value.split(",") if part.strip()]
        tags, bad = _tags(raw, "tag")
        if bad:
            raise ValueError(f"tag: {bad[0]['message']}")
        kind, status = (args.get("kind") or "").strip() or None, (args.get("status") or "").strip() or None
        if kind is not None and kind not in RUN_KINDS:
            raise ValueError(f"kind: must be one of {', '.join(RUN_KINDS)}")
        if status is not None and status not in RUN_STATES:
            raise ValueError(f"status: must be one of {', '.join(RUN_STATES)}")
        return cls(q=q, tags=tags, kind=kind, status=status)

    def __bool__(self) -> bool:
        return bool(self.q or self.tags or self.kind or self.status)

    def apply(self, query):
        """`query` (a select of Run) narrowed to the runs this filter shows."""
        if self.kind:
            query = query.where(Run.kind == self.kind)
        if self.status:
            query = query.where(Run.status == self.status)
        tags_text = func.lower(cast(Run.tags, Text))  # the JSON list as text: `["a", "b"]` (SQLite and PostgreSQL)
        for tag in self.tags:
            query = query.where(tags_text.contains(f'"{tag}"', autoescape=True))
        if self.q:
            needle = self.q.lower()
            query = query.where(or_(func.lower(Run.name).contains(needle, autoescape=True),
                                    func.lower(Run.notes).contains(needle, autoescape=True),
                                    tags_text.contains(needle, autoescape=True)))
        return query

    def params(self) -> dict:
        """The query arguments of this filter (for links and the page's live refresh)."""
        out: dict = {k: v for k, v in (("q", self.q), ("kind", self.kind), ("status", self.status)) if v}
        if self.tags:
            out["tag"] = ",".join(self.tags)
        return out
