"""Library code at a test-looking path is graded as the code under test; a real test helper is still test code.

A small repository in cachetools' layout, built by the real runtime from an inline source and graded
by the real grader under bubblewrap: the library ships a test clock for its users at
`src/cachetools/test/utils.py` (a `test` folder, but part of the installed package), the project's
own tests live in `tests/` beside their helper `tests/helpers.py`.

* The gold patch fixes `src/cachetools/test/utils.py`: it grades resolved, the file kept as library
  code with the reason in the report (under the path-based rule it was put back, and the fix lost).
* An edit of `tests/helpers.py` that makes the failing test pass without a fix grades not resolved:
  the helper sits in the directory of the collected tests and no library code imports it.
* An empty patch does not resolve it.
"""
from __future__ import annotations

import difflib
import json

import pytest

from app.grading import grade
from app.runtimes import bwrap_available
from app.tasksets.schema import InstanceRecord

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap (Debian package `bubblewrap`) is not installed/usable here")

TIMER_FIXED = '''"""A clock for the tests of code that uses a cache with a time-to-live (shipped for users' tests)."""


class FakeTimer:
    def __init__(self, start=0):
        self.time = start

    def __call__(self):
        return self.time

    def tick(self, seconds=1):
        self.time += seconds
        return self.time
'''
TIMER_BUGGY = TIMER_FIXED.replace("self.time += seconds", "self.time += 1")
HELPERS = '''def assert_clock(timer, expected):
    assert timer() == expected, f"clock at {timer()}, expected {expected}"
'''
HELPERS_FORGED = '''def assert_clock(timer, expected):
    return None
'''
FILES = {
    "pyproject.toml": '[project]\nname = "cachetools"\nversion = "0.0.1"\n\n[tool.pytest.ini_options]\npythonpath = ["src"]\n',
    "src/cachetools/__init__.py": '"""Caches."""\n__version__ = "0.0.1"\n',
    "src/cachetools/test/__init__.py": "",
    "src/cachetools/test/utils.py": TIMER_FIXED,
    "tests/__init__.py": "",
    "tests/helpers.py": HELPERS,
    "tests/test_fake_timer.py": '''from cachetools.test.utils import FakeTimer
from tests.helpers import assert_clock


def test_tick_by_seconds():
    timer = FakeTimer()
    timer.tick(5)
    assert_clock(timer, 5)


def test_starts_at_start():
    assert_clock(FakeTimer(3), 3)
''',
}
TEST_CMD = "python -m pytest -rA -p no:cacheprovider --color=no tests/test_fake_timer.py"


def diff(path: str, old: str, new: str) -> str:
    """A git-style unified diff of one file."""
    body = difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{path}", f"b/{path}")
    return f"diff --git a/{path} b/{path}\n" + "".join(body)


RECORD = InstanceRecord.model_validate({
    "instance_id": "layout__cachetools-test-utils", "repo": "turnstile-tests/cachetools-layout",
    "problem_statement": "FakeTimer.tick(5) advances the clock by one second, not five.",
    "FAIL_TO_PASS": json.dumps(["tests/test_fake_timer.py::test_tick_by_seconds"]),
    "PASS_TO_PASS": json.dumps(["tests/test_fake_timer.py::test_starts_at_start"]),
    "source": {"kind": "inline", "name": "cachetools", "version": "0.0.1", "files": FILES},
    "bug_patch": diff("src/cachetools/test/utils.py", TIMER_FIXED, TIMER_BUGGY),
    "patch": diff("src/cachetools/test/utils.py", TIMER_BUGGY, TIMER_FIXED),
    "install": ["python -m pip install -q pytest==8.3.4"],
    "test_cmd": TEST_CMD, "test_files": ["tests/test_fake_timer.py"],
})


def test_a_fix_of_library_code_under_a_test_folder_resolves(grading_settings):
    result = grade(RECORD, RECORD.patch, settings=grading_settings, use_cache=False)
    assert result.report["apply"]["applied"] and result.report["test_env_probed"]
    assert result.report["reverted_files"] == {}, result.report["reverted_files"]
    assert (result.resolved, result.reward) == (True, 1.0), result.report["tests_status"]
    surface = result.report["test_surface"]
    assert surface["layout"]["decided"] and surface["layout"]["test_dirs"] == ["tests"]
    assert surface["kept"]["src/cachetools/test/utils.py"].startswith("library code: part of `cachetools`")


def test_an_edit_of_the_real_test_helper_is_put_back(grading_settings):
    forged = diff("tests/helpers.py", HELPERS, HELPERS_FORGED)
    result = grade(RECORD, forged, settings=grading_settings, use_cache=False)
    assert (result.resolved, result.reward) == (False, 0.0)
    reason = result.report["reverted_files"]["tests/helpers.py"]
    assert reason.startswith("test support: imported by tests/test_fake_timer.py, in the test directory tests")
    assert result.report["test_surface"]["reverted"]["tests/helpers.py"]["rule"] == "test support"
    # put back: the tests ran with the real helper, and the bug is still there
    assert result.report["tests_status"]["FAIL_TO_PASS"]["failure"] == RECORD.FAIL_TO_PASS


def test_the_helper_edit_would_pass_the_tests_as_is_and_nothing_does_not(grading_settings):
    """The forged helper fools pytest when left in place (so the put-back is what stops it)."""
    from app.runtimes import LocalRuntime

    with LocalRuntime.prepare(RECORD, settings=grading_settings) as rt:
        (rt.workspace / "tests/helpers.py").write_text(HELPERS_FORGED)
        out = rt.run(TEST_CMD, timeout_s=300).stdout
    assert "PASSED tests/test_fake_timer.py::test_tick_by_seconds" in out
    empty = grade(RECORD, "", settings=grading_settings, use_cache=False)
    assert (empty.resolved, empty.reward) == (False, 0.0)


def test_tasks_validate_says_what_it_kept_and_why(grading_settings, tmp_path, capsys):
    from app.cli import main

    path = tmp_path / "layouts.jsonl"
    path.write_text(RECORD.model_dump_json() + "\n")
    assert main(["tasks", "validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ok   layout__cachetools-test-utils: gold resolves, empty does not" in out
    assert "· gold: kept src/cachetools/test/utils.py: library code: part of `cachetools`, imported from src" in out
