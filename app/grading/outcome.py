"""What one grade is and where its log goes: `GradeResult`, the record and patch hashes that
name a grade, and swebench's report read into a `GradeResult` (`grade_result`).

Shared by every grader (`grader` in a local runtime, `image` and `harbor` in the task's image),
so none of them imports another for these.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import uuid
from pathlib import Path
from typing import Any

from app.runtimes.paths import RuntimePaths
from app.tasksets.schema import InstanceRecord
from app.tasksets.swebench_compat import grading_module

log = logging.getLogger(__name__)

_OUTCOME_FIELDS = ("instance_id", "patch", "test_patch", "eval_script", "test_cmd", "test_files", "FAIL_TO_PASS",
                   "PASS_TO_PASS", "log_parser", "eval_type", "source", "bug_patch", "install", "python", "base_commit",
                   "image", "repo_dir", "grader", "expected_statuses", "harbor")


@dataclasses.dataclass
class GradeResult:
    """Outcome of one grade.

    resolved: every FAIL_TO_PASS and PASS_TO_PASS test passed (swebench RESOLVED_FULL).
    reward: 1.0 if resolved else 0.0.
    report: swebench's per-instance report (`patch_successfully_applied`, `resolved`,
      `tests_status` {FAIL_TO_PASS, PASS_TO_PASS, FAIL_TO_FAIL, PASS_TO_FAIL → {success, failure}})
      plus `apply` {applied, method, reason}, `dropped_test_files` (dropped from the patch),
      `reverted_files` {path: reason} (put back to the base after applying), `test_surface`
      {layout: {decided, rule, collected_test_files, test_dirs, library_roots}, reverted: {path:
      {rule, why}}, kept: {path: why it is library code}}, `tests_missing`
      {FAIL_TO_PASS, PASS_TO_PASS → ids absent from the test log}, `patch_sha256`,
      `confined`, `timings` (seconds).
    log_path: the grading log (apply output + eval script output), or None.
    cached: True when served from the grade cache.
    """

    resolved: bool
    reward: float
    report: dict[str, Any]
    log_path: str | None
    cached: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def record_hash(record: InstanceRecord) -> str:
    data = record.model_dump(mode="json")
    fields = {k: data.get(k) for k in _OUTCOME_FIELDS}
    if record.harbor is not None:  # a Harbor task's tests live in its folder, not in the record
        fields["harbor_tests"] = _tree_digest(Path(record.harbor.tests_dir))
    blob = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _tree_digest(root: Path) -> str:
    """SHA-256 over the relative paths and bytes of the files under `root` (links by their target)."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")) if root.is_dir() else []:
        h.update(str(p.relative_to(root)).encode())
        h.update(os.readlink(p).encode() if p.is_symlink() else p.read_bytes() if p.is_file() else b"/")
    return h.hexdigest()[:16]


def patch_sha256(patch: str | None) -> str:
    return hashlib.sha256((patch or "").encode("utf-8", errors="surrogateescape")).hexdigest()


def grade_log_path(paths: RuntimePaths, record: InstanceRecord, patch: str) -> Path:
    """A new log file path for one grade of `patch` on `record` (never shared with another grade).

    The instance id becomes a folder name with every character outside `[A-Za-z0-9._-]`
    replaced, so an id cannot name a path outside `paths.grading_logs`.
    """
    folder = re.sub(r"[^A-Za-z0-9._-]", "_", record.instance_id).lstrip(".") or "_"
    name = f"{record_hash(record)}-{patch_sha256(patch)[:16]}-{uuid.uuid4().hex[:8]}.log"
    return paths.grading_logs / folder / name


def grade_result(record: InstanceRecord, spec: Any, kept: str, log_path: Path, apply_info: dict, report_extra: dict,
                 timings: dict, final: bool = True) -> GradeResult:
    """The `GradeResult` of the test log at `log_path`: swebench's `get_eval_report` for `spec` and
    the `kept` patch, with `report_extra`, `apply_info` (as `report["apply"]`), `tests_missing` and
    `timings` added.  Resolved only when swebench says so, the patch applied and no kept file
    reached into the test framework (`report["tampering"]`).

    `final`: swebench's rule is the verdict, so FAIL_TO_PASS ids missing from the log are logged
    here (`warn_missing`); False when a format's own rule judges the log afterwards (SWE-rebench
    V2, R2E-Gym: `app.grading.image`), which then calls `warn_missing` with its own verdict."""
    g = grading_module()
    prediction = {"instance_id": record.instance_id, "model_name_or_path": "turnstile", "model_patch": kept}
    report = g.get_eval_report(spec, prediction, str(log_path), include_tests_status=True)[record.instance_id]
    resolved = bool(report.get("resolved")) and bool(apply_info["applied"])
    report.update(report_extra)
    report["apply"] = apply_info
    report["tests_missing"] = missing_tests(record, spec, log_path)
    report["timings"] = timings
    if report.get("tampering"):  # the code under test reached into the test framework: never a pass
        resolved = False
        report["resolved"] = False
    result = GradeResult(resolved=resolved, reward=1.0 if resolved else 0.0, report=report, log_path=str(log_path))
    if final:
        warn_missing(record, result)
    return result


def warn_missing(record: InstanceRecord, result: GradeResult) -> bool:
    """Log a warning when the verdict is "not resolved" and FAIL_TO_PASS ids never appear in the
    test log (`report["tests_missing"]`, as the rule that judged reads ids): then the grade may
    say more about the instance (unsolvable, a parser that cannot read its runner) than about the
    patch.  Nothing is logged for a resolved grade.  Returns whether it logged."""
    missing_f2p = result.report.get("tests_missing", {}).get("FAIL_TO_PASS") or []
    if result.resolved or not missing_f2p:
        return False
    log.warning("grade of %s: %d FAIL_TO_PASS test id(s) never appear in the test log %s (counted as failed; "
                "the instance may be unsolvable): %s", record.instance_id, len(missing_f2p), result.log_path,
                ", ".join(missing_f2p[:5]))
    return True


def missing_tests(record: InstanceRecord, spec: Any, log_path: Path) -> dict[str, list[str]]:
    """{FAIL_TO_PASS, PASS_TO_PASS → ids the record's log parser did not find in the log}.

    Empty lists when the tests did not run at all (patch not applied, no test output):
    then nothing can be told about single ids.  Matching is swebench's own (`_resolve_case`
    in swebench 5.0.2 `harness/grading.py`, which also accepts its truncated ids).
    """
    g = grading_module()
    out: dict[str, list[str]] = {"FAIL_TO_PASS": [], "PASS_TO_PASS": []}
    status, ran = g.get_logs_eval(spec, str(log_path))
    if not ran or not status:
        return out
    resolve = getattr(g, "_resolve_case", lambda case, sm: case if case in sm else None)
    out["FAIL_TO_PASS"] = [t for t in record.FAIL_TO_PASS if resolve(t, status) is None]
    out["PASS_TO_PASS"] = [t for t in record.PASS_TO_PASS if resolve(t, status) is None]
    return out
