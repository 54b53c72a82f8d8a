"""Why an episode did not resolve its instance, in one line, from what the pipeline recorded.

Read from the episode's row only: `error` (written by the stage that failed it:
`app.control.episodes.fail`, `_harness_failed`, the reaper, a cancel), `timed_out`, `patch`,
and the grading report (`app.grading.outcome.GradeResult.report`: swebench's `tests_status`
plus our `apply`, `tampering`, `tests_missing`; or `forfeit`, `app.control.stages.forfeit_record`).
The first cause in the pipeline's order wins: the setup, the harness, the patch, the tests.
"""
from __future__ import annotations

from app.control.stages import HARNESS_FAILED, LEASE_LOST, STAGE_FAILED
from app.transitions import TERMINAL

# `kind` of a failure reason: one word a filter or a test can match.
FAILURE_KINDS = ("setup_error", "harness_error", "timeout", "grading_error", "worker_lost", "cancelled", "forfeit",
                 "no_patch", "patch_not_applied", "tampering", "fail_to_pass", "pass_to_pass", "no_test_results",
                 "simulated", "error")
_LIST = 3  # test names named in a reason; the rest are counted


def _first_line(text: str | None) -> str:
    return (text or "").strip().split("\n", 1)[0]


def _names(tests: list[str]) -> str:
    shown = ", ".join(tests[:_LIST])
    return shown + (f" and {len(tests) - _LIST} more" if len(tests) > _LIST else "")


def _failed(error: str | None, timed_out: bool) -> tuple[str, str]:
    line = _first_line(error)
    if error and error.startswith(HARNESS_FAILED):
        return ("timeout" if timed_out else "harness_error"), line
    for stage, kind in (("prepare", "setup_error"), ("rollout", "harness_error"), ("grading", "grading_error")):
        if line.startswith(STAGE_FAILED[stage]):
            return kind, line
    if LEASE_LOST in line:
        return "worker_lost", line
    if timed_out:
        return "timeout", line or "the harness timed out"
    return "error", line or "failed with no error recorded"


def _graded(report: dict, patch: str | None, timed_out: bool) -> tuple[str, str]:
    late = " (the harness had timed out)" if timed_out else ""
    apply = report.get("apply") or {}
    if report.get("simulated"):
        return "simulated", "simulated grade: not resolved (no tests ran)"
    if not (patch or "").strip() or apply.get("method") == "empty patch":
        if timed_out:
            return "timeout", "the harness timed out before the agent produced a patch"
        return "no_patch", "the agent produced no patch"
    if apply and not apply.get("applied"):
        return "patch_not_applied", "the patch did not apply: " + (_first_line(apply.get("reason")) or "no reason recorded")
    if report.get("tampering"):
        return "tampering", "the patch reaches into the test framework: " + _names(sorted(report["tampering"])) + late
    status = report.get("tests_status") or {}
    f2p = list((status.get("FAIL_TO_PASS") or {}).get("failure") or [])
    p2p = list((status.get("PASS_TO_PASS") or {}).get("failure") or [])
    missing = set((report.get("tests_missing") or {}).get("FAIL_TO_PASS") or [])
    parts = []
    if f2p:
        never = [t for t in f2p if t in missing]
        parts.append(f"{len(f2p)} FAIL_TO_PASS test{'s' if len(f2p) > 1 else ''} failing: {_names(f2p)}"
                     + (f" ({len(never)} never ran)" if never else ""))
    if p2p:
        parts.append(f"{len(p2p)} PASS_TO_PASS test{'s' if len(p2p) > 1 else ''} broken: {_names(p2p)}")
    if parts:
        return ("fail_to_pass" if f2p else "pass_to_pass"), "; ".join(parts) + late
    ran = any((v or {}).get("success") for v in status.values())
    if not ran:
        return "no_test_results", "the tests reported no results (they timed out or crashed: see the grading log)" + late
    return "error", "not resolved, though no listed test failed (see the grading report)" + late


def failure_reason(status: str, resolved: bool | None, error: str | None, timed_out: bool | None,
                   patch: str | None, report: dict | None) -> dict | None:
    """{"kind" (one of `FAILURE_KINDS`), "text" (one line)} for an episode that ended without
    resolving its instance (status `failed` or `cancelled`, or `completed` and not resolved);
    None for a resolved episode or one still in progress.

    `status`, `resolved`, `error`, `timed_out`, `patch`, `report`: the episode's columns
    (`grading_report` as stored)."""
    if status not in TERMINAL or (status == "completed" and resolved):
        return None
    if status == "failed":
        kind, text = _failed(error, bool(timed_out))
    elif status == "cancelled":
        kind, text = "cancelled", _first_line(error) or "cancelled"
    else:
        report = report or {}
        forfeit = report.get("forfeit")
        if forfeit:
            kind, text = "forfeit", "reward 0, not graded: " + _first_line(forfeit.get("reason") or forfeit.get("cause"))
        else:
            kind, text = _graded(report, patch, bool(timed_out))
    return {"kind": kind, "text": text}
