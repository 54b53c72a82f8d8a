"""Published task formats, as published: each module turns its rows (or folders) into `InstanceRecord` input.

    fmt = detect_format(rows[0], set_name)    # "swebench" | "swegym" | "swesmith" | "rebench" | "r2egym" | "turnstile"
    converted = convert(fmt, rows)            # [Converted(row | None, error, warnings)], in order
    tasks = harbor.task_dirs(folder)          # Harbor task folders (`task.toml`)

`turnstile` rows (today's records: `eval_script`/`test_cmd`/`source` present) pass unchanged.
Detection reads one row's keys, in the order below (a SWE-rebench V2 row is also SWE-bench-
shaped, so the more specific formats are tried first).
"""
from __future__ import annotations

from typing import Any, Sequence

from app.tasksets.formats import harbor, r2egym, rebench, swebench, swesmith
from app.tasksets.formats.common import Converted

FORMATS = ("rebench", "r2egym", "swesmith", "swebench", "swegym", "harbor", "turnstile")


def detect_format(row: Any, set_name: str = "") -> str:
    """The format of `row` (a dict; anything else is `turnstile`, whose validation reports it).

    `set_name`: the task set's path or name; SWE-Gym rows are SWE-bench rows told apart by it.
    """
    if not isinstance(row, dict):
        return "turnstile"
    if rebench.looks_like(row):
        return "rebench"
    if r2egym.looks_like(row):
        return "r2egym"
    if swesmith.looks_like(row):
        return "swesmith"
    if swebench.looks_like(row):
        return "swegym" if swebench.is_swegym(set_name) else "swebench"
    return "turnstile"


def convert(fmt: str, rows: Sequence[dict[str, Any]]) -> list[Converted]:
    """Convert `rows` of format `fmt` (see `detect_format`); raises ValueError for an unknown format."""
    if fmt == "turnstile":
        return [Converted(dict(r) if isinstance(r, dict) else r) for r in rows]
    table = {"rebench": rebench.convert_rows, "r2egym": r2egym.convert_rows, "swesmith": swesmith.convert_rows,
             "swebench": swebench.convert_rows, "swegym": lambda rs: swebench.convert_rows(rs, swegym=True)}
    if fmt not in table:
        raise ValueError(f"unknown task format {fmt!r} (known: {', '.join(FORMATS)})")
    return table[fmt](rows)


__all__ = ["FORMATS", "Converted", "detect_format", "convert", "harbor"]
