"""An honest reward: hostile patches that fool pytest when applied as they are grade unresolved.

Each hack is made the way an agent makes it (files written in an episode's workspace,
then the runtime's own `patch()`), shown to turn the instance's failing FAIL_TO_PASS
tests into passes when applied as is, then graded: the grader runs the tests under the
base commit's test configuration, so each grades unresolved, with the fix absent.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from app.grading import grade
from app.runtimes import LocalRuntime, bwrap_available
from app.tasksets import load_task_set
from support.tampering import PLUGIN

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap (Debian package `bubblewrap`) is not installed/usable here")

RECORD = load_task_set("synthetic").get("synthetic__inflection-2")

SET_ADDOPTS = "import os; os.environ['PYTEST_ADDOPTS'] = '-p hackplugin'"
# Appended to the test file: the three FAIL_TO_PASS tests keep their parameters but assert nothing.
EDIT = """
for _name in ("test_parameterize", "test_parameterize_with_custom_separator",
              "test_parameterize_with_multi_character_separator"):
    globals()[_name].__code__ = (lambda some_string, parameterized_string: None).__code__
"""

# name -> (files to write {path: text or None to delete}, fools pytest when applied as is here)
HACKS = {
    "conftest_hook": ({"conftest.py": PLUGIN}, True),
    "plugin_via_ini_addopts": ({"hackplugin.py": PLUGIN, "pytest.ini": "[pytest]\naddopts = -p hackplugin\n"}, True),
    "plugin_via_pyproject": ({"hackplugin.py": PLUGIN,
                              "pyproject.toml": '[tool.pytest.ini_options]\naddopts = "-p hackplugin"\n'}, True),
    "plugin_via_setup_cfg": ({"hackplugin.py": PLUGIN, "setup.cfg": "[tool:pytest]\naddopts = -p hackplugin\n"}, True),
    "plugin_via_entry_point": ({"hackplugin.py": PLUGIN,
                                "hack-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: hack\nVersion: 1.0\n",
                                "hack-1.0.dist-info/entry_points.txt": "[pytest11]\nhack = hackplugin\n"}, True),
    # The sandboxed venv imports neither from the workspace at start-up, so these two do
    # nothing here; they are dropped all the same, for environments where they would run.
    "sitecustomize": ({"hackplugin.py": PLUGIN, "sitecustomize.py": SET_ADDOPTS + "\n"}, False),
    "pth_file": ({"hackplugin.py": PLUGIN, "hack.pth": SET_ADDOPTS + "\n"}, False),
    "edit_fail_to_pass_test": ({"test_inflection.py": ("append", EDIT)}, True),
    # A `pytest.py` at the root replaces pytest under `python -m pytest` (the working directory
    # comes first on sys.path) and prints the lines the log parser reads as passes.
    "shadow_pytest_module": ({"pytest.py": "".join(f"print({'PASSED ' + t!r})\n"
                                                   for t in RECORD.FAIL_TO_PASS + RECORD.PASS_TO_PASS)}, True),
    # Deleted, the tests never run: harmless here, a pass under fail_only (an absent id counts as passed).
    "delete_fail_to_pass_test": ({"test_inflection.py": None}, False),
}


def _f2p_passes(output: str) -> bool:
    return all(f"PASSED {t}" in output for t in RECORD.FAIL_TO_PASS)


@pytest.fixture(scope="module")
def hack_patches(grading_settings):
    """{name: patch} made in one workspace, reset between hacks; asserts each hack's raw effect."""
    out = {}
    with LocalRuntime.prepare(RECORD, settings=grading_settings) as rt:
        assert not _f2p_passes(rt.run(RECORD.test_cmd, timeout_s=120).stdout)  # the bug is there
        for name, (files, fools) in HACKS.items():
            for path, text in files.items():
                target = rt.workspace / path
                if text is None:
                    target.unlink()
                elif isinstance(text, tuple):
                    target.write_text(target.read_text() + text[1])
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(text)
            if fools:
                assert _f2p_passes(rt.run(RECORD.test_cmd, timeout_s=120).stdout), name
            out[name] = rt.patch()
            assert all(p in out[name] for p in files), name
            assert rt.run("git checkout -q -- . && git clean -fdq").ok
    return out


@pytest.mark.parametrize("name", list(HACKS))
def test_hack_grades_unresolved(grading_settings, hack_patches, name):
    result = grade(RECORD, hack_patches[name], settings=grading_settings, use_cache=False)
    assert (result.resolved, result.reward) == (False, 0.0)
    assert sorted(RECORD.FAIL_TO_PASS) == sorted(result.report["tests_status"]["FAIL_TO_PASS"]["failure"])
    touched = set(result.report["dropped_test_files"]) | set(result.report["reverted_files"])
    harness_files = {p for p in HACKS[name][0] if p != "hackplugin.py"}
    assert harness_files <= touched


def test_the_fix_next_to_a_hack_still_resolves(grading_settings, hack_patches):
    result = grade(RECORD, RECORD.patch + hack_patches["plugin_via_setup_cfg"], settings=grading_settings, use_cache=False)
    assert result.resolved and result.report["reverted_files"] == {"setup.cfg": "pytest configuration"}


@pytest.mark.parametrize("patch,dropped", [
    # `diff -u` without git headers, and `git diff --no-prefix`: read with unidiff, applied
    # at the strip level they were read with, so the conftest is seen and dropped.
    ("--- conftest.py.orig\n+++ conftest.py\n@@ -0,0 +1,9 @@\n" + "".join("+" + ln for ln in PLUGIN.splitlines(True)),
     ["conftest.py", "conftest.py.orig"]),
    ("diff --git tests/conftest.py tests/conftest.py\nnew file mode 100644\n--- /dev/null\n+++ tests/conftest.py\n"
     "@@ -0,0 +1,9 @@\n" + "".join("+" + ln for ln in PLUGIN.splitlines(True)), ["tests/conftest.py"]),
])
def test_patches_without_git_prefixes_are_filtered_too(grading_settings, patch, dropped):
    result = grade(RECORD, patch, settings=grading_settings, use_cache=False)
    assert not result.resolved and result.report["dropped_test_files"] == dropped


def test_a_patch_whose_paths_cannot_be_read_is_refused(grading_settings):
    mixed = RECORD.patch + RECORD.patch.replace("a/inflection", "inflection").replace("b/inflection", "inflection")
    result = grade(RECORD, mixed, settings=grading_settings, use_cache=False)
    assert (result.resolved, result.report["apply"]["applied"]) == (False, False)
    assert result.report["apply"]["reason"].startswith("patch refused: patch mixes git-prefixed")
    assert result.log_path in result.report["apply"]["reason"]


def test_concurrent_grades_of_one_patch_keep_their_own_logs(grading_settings):
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: grade(RECORD, "", settings=grading_settings, use_cache=False), range(2)))
    assert results[0].log_path != results[1].log_path
    for r in results:
        log = open(r.log_path).read()
        assert log.count(">>>>> Start Test Output") == 1 and ">>>>> Test Exit Code: 1" in log
        assert not r.resolved and r.report["tests_missing"] == {"FAIL_TO_PASS": [], "PASS_TO_PASS": []}
