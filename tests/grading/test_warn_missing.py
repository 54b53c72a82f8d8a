"""`app.grading.outcome.warn_missing`: FAIL_TO_PASS ids missing from the test log are logged only
when they are part of the verdict (the grade is not resolved), never for a resolved grade; the
image grader calls it after a format's own rule (SWE-rebench V2, R2E-Gym) has judged the log."""
from __future__ import annotations

import logging

import pytest

from app.grading.outcome import GradeResult, warn_missing
from app.tasksets import load_task_set


@pytest.fixture
def record():
    return load_task_set("synthetic").get("synthetic__inflection-1")


def _result(resolved: bool, missing: list[str]) -> GradeResult:
    return GradeResult(resolved=resolved, reward=float(resolved), log_path="/logs/grade.log",
                       report={"tests_missing": {"FAIL_TO_PASS": missing, "PASS_TO_PASS": []}})


def test_missing_ids_of_an_unresolved_grade_are_logged(record, caplog):
    with caplog.at_level(logging.WARNING, logger="app.grading.outcome"):
        assert warn_missing(record, _result(False, ["tests/test_a.py::test_x"]))
    assert "1 FAIL_TO_PASS test id(s) never appear in the test log /logs/grade.log" in caplog.text
    assert "tests/test_a.py::test_x" in caplog.text


@pytest.mark.parametrize(("resolved", "missing"), [(True, ["tests/test_a.py::test_x"]), (False, [])])
def test_a_resolved_grade_or_one_missing_nothing_logs_nothing(record, caplog, resolved, missing):
    with caplog.at_level(logging.WARNING, logger="app.grading.outcome"):
        assert not warn_missing(record, _result(resolved, missing))
    assert caplog.text == ""
