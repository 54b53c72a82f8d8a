"""The episode page's table of what the grader put back of a patch and what it kept, rule by rule."""
from __future__ import annotations

from app.api.dashboard.episode import grading_surface


def test_rows_name_the_rule_and_why_for_each_file():
    report = {"reverted_files": {"tests/helpers.py": "test support: imported by tests/test_a.py, in the test directory tests"},
              "test_surface": {
                  "layout": {"decided": True, "rule": "test code is what pytest collects and what only the tests use"},
                  "reverted": {"tests/helpers.py": {"rule": "test support", "why": "test support: imported by tests/test_a.py"}},
                  "kept": {"src/pkg/test/utils.py": "library code: part of `pkg`, imported from src"}}}
    view = grading_surface(report)
    assert view["undecided"] is None
    assert view["rows"] == [
        {"path": "tests/helpers.py", "action": "put back", "rule": "test support", "why": "test support: imported by tests/test_a.py"},
        {"path": "src/pkg/test/utils.py", "action": "kept", "rule": "library code",
         "why": "library code: part of `pkg`, imported from src"}]


def test_an_undecided_layout_and_an_older_report_are_shown():
    view = grading_surface({"test_surface": {"layout": {"decided": False, "rule": "the conservative rule"},
                                             "reverted": {}, "kept": {}}})
    assert view == {"rows": [], "undecided": "the conservative rule"}
    older = grading_surface({"reverted_files": {"setup.cfg": "pytest configuration"}})  # before test_surface existed
    assert older["rows"] == [{"path": "setup.cfg", "action": "put back", "rule": "", "why": "pytest configuration"}]
    assert grading_surface(None) == {"rows": [], "undecided": None}
