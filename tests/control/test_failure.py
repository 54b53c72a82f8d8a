"""Every way an episode ends unresolved gets its reason (`app.control.failure.failure_reason`),
from the rows the pipeline writes: stage errors, the timeout flag, the patch, the grading report."""
from __future__ import annotations

import pytest

from app.control.failure import FAILURE_KINDS, failure_reason
from app.control.stages import HARNESS_FAILED, forfeit_record

PATCH = "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1 +1 @@\n-a - b\n+a + b\n"
F2P = ["tests/test_calc.py::test_add", "tests/test_calc.py::test_sub", "tests/test_calc.py::test_mul",
       "tests/test_calc.py::test_div"]


def report(f2p_failed=(), p2p_failed=(), applied=True, method="git apply --verbose", reason=None, **extra) -> dict:
    """swebench's `get_eval_report` shape plus what our grader adds (`app.grading.outcome`)."""
    return {"patch_successfully_applied": applied, "resolved": False,
            "tests_status": {"FAIL_TO_PASS": {"success": [t for t in F2P if t not in f2p_failed], "failure": list(f2p_failed)},
                             "PASS_TO_PASS": {"success": ["tests/test_calc.py::test_old"], "failure": list(p2p_failed)}},
            "apply": {"applied": applied, "method": method, "reason": reason}, **extra}


CASES = [
    # (status, error, timed_out, patch, report) -> (kind, words the reason holds)
    (("completed", None, False, "", report(applied=True, method="empty patch")), ("no_patch", "the agent produced no patch")),
    (("completed", None, True, "", report(applied=True, method="empty patch")),
     ("timeout", "the harness timed out before the agent produced a patch")),
    (("completed", None, False, PATCH, report(applied=False, method=None,
                                             reason="git apply failed (exit 1): error: calc.py: patch does not apply\nlog: x")),
     ("patch_not_applied", "the patch did not apply: git apply failed (exit 1): error: calc.py: patch does not apply")),
    (("completed", None, False, PATCH, report(f2p_failed=F2P)),
     ("fail_to_pass", "4 FAIL_TO_PASS tests failing: tests/test_calc.py::test_add, tests/test_calc.py::test_sub, "
                      "tests/test_calc.py::test_mul and 1 more")),
    (("completed", None, False, PATCH, report(f2p_failed=F2P[:1], tests_missing={"FAIL_TO_PASS": F2P[:1]})),
     ("fail_to_pass", "1 FAIL_TO_PASS test failing: tests/test_calc.py::test_add (1 never ran)")),
    (("completed", None, False, PATCH, report(p2p_failed=["tests/test_calc.py::test_old"])),
     ("pass_to_pass", "1 PASS_TO_PASS test broken: tests/test_calc.py::test_old")),
    (("completed", None, True, PATCH, report(f2p_failed=F2P[:1], p2p_failed=["tests/test_calc.py::test_old"])),
     ("fail_to_pass", "1 FAIL_TO_PASS test failing: tests/test_calc.py::test_add; 1 PASS_TO_PASS test broken: "
                      "tests/test_calc.py::test_old (the harness had timed out)")),
    (("completed", None, False, PATCH, {**report(), "tests_status": {"FAIL_TO_PASS": {"success": [], "failure": []},
                                                                     "PASS_TO_PASS": {"success": [], "failure": []}}}),
     ("no_test_results", "the tests reported no results")),
    (("completed", None, False, PATCH, report(tampering={"conftest.py": ["pytest hook"]})),
     ("tampering", "the patch reaches into the test framework: conftest.py")),
    (("completed", None, False, PATCH, {"resolved": False, "forfeit": forfeit_record("sandbox_limit", "process cap hit")}),
     ("forfeit", "reward 0, not graded: process cap hit")),
    (("completed", None, False, "", {"simulated": True}), ("simulated", "simulated grade")),
    (("failed", HARNESS_FAILED + "exit 1: ModuleNotFoundError: No module named 'yaml'\n--- log tail ---\n...", False, "", None),
     ("harness_error", "harness failed before any usable model call: exit 1: ModuleNotFoundError")),
    (("failed", HARNESS_FAILED + "timed out after 600 s before its first answered call", True, "", None),
     ("timeout", "timed out after 600 s")),
    (("failed", "prepare failed: RuntimeSetupError: pip install failed", False, None, None),
     ("setup_error", "prepare failed: RuntimeSetupError")),
    (("failed", "rollout failed: OSError: bwrap: No permissions", False, None, None),
     ("harness_error", "rollout failed: OSError")),
    (("failed", "grading failed: TimeoutError: eval.sh", False, PATCH, None), ("grading_error", "grading failed: TimeoutError")),
    (("failed", "grading lost with its worker: the stage's lease expired after 3 re-dispatches "
                "(TURNSTILE_MAX_REDELIVERIES=3)", False, PATCH, None), ("worker_lost", "lease expired")),
    (("failed", None, True, "", None), ("timeout", "the harness timed out")),
    (("failed", "something else broke", False, "", None), ("error", "something else broke")),
    (("cancelled", "straggler cancelled: group had enough graded episodes", False, "", None),
     ("cancelled", "straggler cancelled")),
]


@pytest.mark.parametrize("row, expected", CASES, ids=[f"{c[1][0]}-{i}" for i, c in enumerate(CASES)])
def test_each_unresolved_end_has_its_reason(row, expected):
    status, error, timed_out, patch, rep = row
    got = failure_reason(status, False if status == "completed" else None, error, timed_out, patch, rep)
    assert got["kind"] == expected[0] and expected[1] in got["text"], got
    assert "\n" not in got["text"]


def test_every_kind_is_seeded():
    assert {c[1][0] for c in CASES} == set(FAILURE_KINDS)


@pytest.mark.parametrize("status", ["queued", "preparing", "ready", "running", "grading"])
def test_no_reason_while_the_episode_is_in_progress(status):
    assert failure_reason(status, None, None, False, None, None) is None


def test_no_reason_for_a_resolved_episode():
    assert failure_reason("completed", True, None, False, PATCH, {**report(), "resolved": True}) is None
