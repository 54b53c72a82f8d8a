"""Grading: cache hit on the second identical grade (real Redis), patches that don't apply, test-file tampering."""
from __future__ import annotations

import json

import pytest

from app import config
from app.config import ROOT, get_settings
from app.grading import cache_key, drop_test_changes, grade
from app.runtimes import LocalRuntime, bwrap_available
from app.tasksets import load_task_set

REDIS_DB = 13

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap (Debian package `bubblewrap`) is not installed/usable here")

# A conftest.py that turns every test report into "passed" (a known reward hack).  Clearing
# longrepr too makes pytest print a clean `PASSED <id>` line, which swebench's parser reads.
CONFTEST_HACK = '''diff --git a/conftest.py b/conftest.py
new file mode 100644
--- /dev/null
+++ b/conftest.py
@@ -0,0 +1,8 @@
+import pytest
+
+@pytest.hookimpl(hookwrapper=True)
+def pytest_runtest_makereport(item, call):
+    outcome = yield
+    rep = outcome.get_result()
+    rep.outcome = "passed"
+    rep.longrepr = None
'''


@pytest.fixture
def settings(tmp_path, monkeypatch):
    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("TURNSTILE_CACHE_DIR", str(ROOT / "var" / "cache"))
    config.reset_settings()
    yield get_settings()
    config.reset_settings()


@pytest.fixture
def record():
    return load_task_set("synthetic").get("synthetic__inflection-2")


def test_second_identical_grade_is_a_cache_hit(settings, redis_db, record):
    first = grade(record, record.patch, settings=settings, redis_client=redis_db)
    assert first.resolved and first.reward == 1.0 and not first.cached
    key = cache_key(record, record.patch)
    assert redis_db.exists(key) and redis_db.ttl(key) > 0
    second = grade(record.as_swebench(), record.patch, settings=settings, redis_client=redis_db)  # HF dict form
    assert second.cached
    assert (second.resolved, second.reward, second.report, second.log_path) == (
        first.resolved, first.reward, first.report, first.log_path)
    # A different patch (here: none) is another key and is graded afresh.
    other = grade(record, "", settings=settings, redis_client=redis_db)
    assert not other.cached and not other.resolved and other.reward == 0.0
    assert len(redis_db.keys("turnstile:grade:*")) == 2


def test_patch_that_does_not_apply_scores_zero_with_reason(settings, record):
    # Context and removed lines that exist nowhere in the file: no fuzz can place it.
    broken = (
        "diff --git a/inflection/__init__.py b/inflection/__init__.py\n"
        "--- a/inflection/__init__.py\n+++ b/inflection/__init__.py\n"
        "@@ -10,3 +10,3 @@\n unrelated context one\n-a line that is not in the file\n+replacement\n"
        " unrelated context two\n"
    )
    result = grade(record, broken, settings=settings, use_cache=False)
    assert (result.resolved, result.reward) == (False, 0.0)
    assert result.report["apply"]["applied"] is False
    first, *errors = result.report["apply"]["reason"].splitlines()
    assert first.startswith("patch did not apply with any of the 4 methods") and result.log_path in first
    assert "error: patch failed: inflection/__init__.py:10" in errors
    assert result.report["patch_successfully_applied"] is False
    assert ">>>>> Patch Apply Failed" in open(result.log_path).read()


def test_a_fuzzy_patch_applies_through_the_fallback_chain(settings, record):
    # Edit the hunk's first context line: `git apply` (exact context, also --3way/--reject)
    # refuses, GNU `patch --fuzz=5` accepts, as in swebench's chain.
    first_context = "        # No more than one of the separator in a row.\n"
    assert first_context in record.patch
    fuzzy = record.patch.replace(first_context, "        # (this comment was reworded)\n", 1)
    result = grade(record, fuzzy, settings=settings, use_cache=False)
    assert result.report["apply"]["applied"] is True
    assert result.report["apply"]["method"] == "patch --batch --forward --fuzz=5 -p1 -i"
    assert result.resolved


def test_test_file_and_conftest_changes_are_dropped(settings, record):
    # The hack really works when applied (so dropping it is what protects the grade) ...
    with LocalRuntime.prepare(record, settings=settings) as rt:
        assert rt.run("git apply -", stdin=CONFTEST_HACK).exit_code == 0
        res = rt.run(record.test_cmd, timeout_s=120)
        assert res.exit_code == 0 and "failed" not in res.stdout.splitlines()[-1]
        assert all(f"PASSED {t}" in res.stdout for t in record.FAIL_TO_PASS)
    # ... and the grader drops it: without the fix the instance stays unresolved.
    tamper = CONFTEST_HACK + (
        "diff --git a/test_inflection.py b/test_inflection.py\n"
        "deleted file mode 100644\n"
    )
    kept, dropped = drop_test_changes(tamper, record.test_files)
    assert kept == "" and dropped == ["conftest.py", "test_inflection.py"]
    hacked = grade(record, CONFTEST_HACK, settings=settings, use_cache=False)
    assert hacked.report["dropped_test_files"] == ["conftest.py"]
    assert not hacked.resolved
    with_fix = grade(record, record.patch + CONFTEST_HACK, settings=settings, use_cache=False)
    assert with_fix.resolved and with_fix.report["dropped_test_files"] == ["conftest.py"]


def test_report_lists_fail_to_pass_and_pass_to_pass(settings, record):
    result = grade(record, "", settings=settings, use_cache=False)
    status = result.report["tests_status"]
    assert sorted(status["FAIL_TO_PASS"]["failure"]) == sorted(record.FAIL_TO_PASS)
    assert sorted(status["PASS_TO_PASS"]["success"]) == sorted(record.PASS_TO_PASS)
    assert result.report["confined"] is True
    log = open(result.log_path).read()
    assert ">>>>> Start Test Output" in log and ">>>>> Test Exit Code: 1" in log
    json.dumps(result.to_dict())  # storable as the episode's grading_report
