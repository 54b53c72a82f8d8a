"""The bundled `layouts` set: library code at test-looking paths of six real sdists, graded end to end.

For every instance, `tasks validate`'s check (the product's grader, fresh runtimes from the cached sdist,
bubblewrap): the gold fix of the library file resolves, an empty patch does not, and the grader keeps the
fixed file (nothing put back).  Where the failing tests assert through a real test helper beside them
(`helper_edit`), gutting that helper passes the tests as is but grades not resolved: it is put back.
Sdists, bases and venvs are cached under `var/cache` of the checkout, as for the synthetic set.
"""
from __future__ import annotations

import pytest

from app.config import ROOT, Settings
from app.grading import grade
from app.grading.validate import validate_instances
from app.runtimes import bwrap_available
from app.tasksets import load_task_set

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not bwrap_available(), reason="bubblewrap (Debian package `bubblewrap`) is not installed/usable here"),
]

LAYOUTS = load_task_set("layouts")


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TURNSTILE_CACHE_DIR", str(ROOT / "var" / "cache"))
        yield Settings.from_env().model_copy(update={"var_dir": tmp_path_factory.mktemp("var")})


@pytest.fixture(scope="module")
def checks(settings):
    return {c.instance_id: c for c in validate_instances(LAYOUTS.instances, jobs=2, settings=settings)}


def test_the_set_has_six_projects_with_library_code_at_test_looking_paths():
    from app.grading.testcode import is_testish

    records = LAYOUTS.instances
    assert len({r.source.name for r in records}) == 6
    assert all(is_testish(r.model_extra["layout_file"]) for r in records)
    assert all(r.source.kind == "pypi_sdist" and r.bug_patch for r in records)


@pytest.mark.parametrize("instance_id", [r.instance_id for r in LAYOUTS.instances])
def test_gold_resolves_empty_does_not_and_the_fix_is_kept(checks, instance_id):
    check = checks[instance_id]
    assert check.problems == [], check.problems
    record = LAYOUTS.get(instance_id)
    gold = check.gold.report
    assert (check.gold.resolved, check.empty.resolved) == (True, False)
    assert gold["reverted_files"] == {} and gold["tampering"] == {}
    assert gold["test_surface"]["layout"]["decided"]
    assert record.model_extra["layout_file"] not in gold["test_surface"]["reverted"]


@pytest.mark.parametrize("instance_id", [r.instance_id for r in LAYOUTS.instances if "helper_edit" in r.model_extra])
def test_a_helper_edit_that_passes_the_failing_tests_grades_not_resolved(settings, instance_id):
    import subprocess

    from app.runtimes import LocalRuntime

    record = LAYOUTS.get(instance_id)
    edit = record.model_extra["helper_edit"]
    helper = edit.split("\n", 1)[0].split(" b/")[-1]
    with LocalRuntime.prepare(record, settings=settings) as rt:  # the edit fools pytest when left in place
        subprocess.run(["git", "apply", "-"], cwd=rt.workspace, input=edit, text=True, check=True)
        out = rt.run(record.test_cmd, timeout_s=900).stdout
    assert all(f"PASSED {t}" in out for t in record.FAIL_TO_PASS)
    result = grade(record, edit, settings=settings, use_cache=False)
    assert (result.resolved, result.reward) == (False, 0.0)
    assert result.report["test_surface"]["reverted"][helper]["rule"] == "test support"
    assert sorted(result.report["tests_status"]["FAIL_TO_PASS"]["failure"]) == sorted(record.FAIL_TO_PASS)
