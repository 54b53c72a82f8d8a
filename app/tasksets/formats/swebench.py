"""SWE-bench, SWE-bench Verified / Lite and SWE-Gym rows, as published on the HF hub.

Row (swebench 5.0.2 `swebench/types.py::SWEbenchInstance`, the HF dataset cards):
`instance_id, repo, base_commit, patch, test_patch, problem_statement, hints_text,
created_at, version, FAIL_TO_PASS, PASS_TO_PASS, environment_setup_commit` (Verified adds
`difficulty`); the test lists are JSON text.  No eval script: it is built by swebench's own
code for the row's repo and version (`swebench_specs`), and a repo or version its spec table
does not know is refused at load with the reason.  A row that has `eval_script` (swebench
5's data columns, or a SkyRL-style export) keeps it.

Image: the row's `image` (or `image_name`), else swebench's name for it:
`swebench/sweb.eval.x86_64.<id, __ → _1776_>:latest` (4.1.0 `TestSpec.instance_image_key`).
SWE-Gym rows use its own images, `xingyaoww/sweb.eval.x86_64.<id, __ → _s_>:latest`
(SWE-Gym's README); they are told apart by the task set's name (`swe-gym` / `swegym` in the
path), as NeMo Gym's `swe_agents` routes datasets by name.  The repository is at /testbed and
the eval script activates conda's `testbed` env, as in every swebench image.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

from app.tasksets.formats.common import Converted, fail_only, swebench_parser_name, unknown_keys
from app.tasksets.formats.swebench_specs import SpecsUnavailable, eval_specs

FIELDS = frozenset({
    "instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement", "hints_text", "created_at",
    "version", "FAIL_TO_PASS", "PASS_TO_PASS", "environment_setup_commit", "difficulty",
    # swebench 5 data columns
    "image", "image_name", "eval_script", "log_parser", "eval_type", "image_assets",
})
SWEGYM_NAMESPACE = "xingyaoww"


def is_swegym(set_name: str) -> bool:
    """True when the task set's path names SWE-Gym (`swe-gym`, `swe_gym`, `swegym`, any case)."""
    return re.search(r"swe[-_]?gym", set_name, re.IGNORECASE) is not None


def looks_like(row: dict[str, Any]) -> bool:
    """A published SWE-bench-schema row: the HF columns and no way to grade it yet (no `eval_script`,
    `test_cmd` or `source`: a row with those is a record as today's loader reads it)."""
    return {"instance_id", "repo", "base_commit", "FAIL_TO_PASS", "version"} <= set(row) and not (
        {"eval_script", "test_cmd", "source", "install_config"} & set(row))


def swegym_image(instance_id: str) -> str:
    return f"{SWEGYM_NAMESPACE}/sweb.eval.x86_64.{instance_id.replace('__', '_s_')}:latest".lower()


def convert_rows(rows: Sequence[dict[str, Any]], *, swegym: bool = False) -> list[Converted]:
    """Convert rows (in order); one `Converted` each."""
    fmt = "SWE-Gym" if swegym else "SWE-bench"
    need = [r for r in rows if not r.get("eval_script") and isinstance(r.get("instance_id"), str)]
    try:
        specs = eval_specs(need) if need else {}
        unavailable = None
    except SpecsUnavailable as exc:
        specs, unavailable = {}, str(exc)
    out = []
    for row in rows:
        warnings = unknown_keys(row, FIELDS, fmt)
        iid = row.get("instance_id")
        rec = dict(row)
        rec.pop("image_name", None)
        rec["source"] = {"kind": "image"}
        rec.setdefault("repo_dir", "/testbed")
        if not row.get("eval_script"):
            spec = specs.get(iid) if isinstance(iid, str) else None
            if unavailable:
                out.append(Converted(None, ("eval_script", unavailable), warnings))
                continue
            if spec is None or "error" in spec:
                why = spec["error"] if spec else "no instance_id"
                out.append(Converted(None, ("version", f"no eval script can be built: {why}"), warnings))
                continue
            rec["eval_script"] = spec["eval_script"]
            default_image = spec["image"]
        else:
            default_image = f"swebench/sweb.eval.x86_64.{str(iid).replace('__', '_1776_')}:latest".lower()
        rec["image"] = row.get("image") or row.get("image_name") or (
            swegym_image(str(iid)) if swegym else default_image)
        if not row.get("log_parser"):
            parser = swebench_parser_name(str(row.get("repo", "")))
            if parser is None:
                out.append(Converted(None, ("repo", f"swebench maps no log parser to repo {row.get('repo')!r}"),
                                     warnings))
                continue
            rec["log_parser"] = parser
        rec.setdefault("eval_type", "fail_only" if fail_only(str(row.get("repo", ""))) else "pass_and_fail")
        out.append(Converted(rec, None, warnings))
    return out
