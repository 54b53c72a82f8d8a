"""Test-surface tampering that a path filter misses, graded on real instances with the real grader.

Each hack is made the way an agent makes it (files written in an episode's workspace, then the
runtime's own `patch()`), shown to turn the instance's failing FAIL_TO_PASS tests into passes
when applied as is, then graded: each grades unresolved, with the reason recorded
(`reverted_files` or `tampering`).  Before `app.grading.surface` each of these graded resolved.
"""
from __future__ import annotations

import pytest

from app.grading import grade
from app.runtimes import LocalRuntime, bwrap_available
from app.tasksets import load_task_set
from support.tampering import PLUGIN, REPORT_HACK

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap (Debian package `bubblewrap`) is not installed/usable here")

SYNTHETIC = load_task_set("synthetic")
INFLECTION = SYNTHETIC.get("synthetic__inflection-2")
HUMANIZE = SYNTHETIC.get("synthetic__humanize-3")
TOOLZ = SYNTHETIC.get("synthetic__toolz-2")

FREEZEGUN_STUB = '''

class freeze_time:
    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __call__(self, fn):
        return fn
'''
# A new FAIL_TO_PASS test that asserts through the package's helper `toolz.utils.raises`.
HELPER_TEST = '''

def test_get_in_treats_a_non_container_as_missing():
    assert not raises(TypeError, lambda: get_in(["a", "b", "c"], {"a": {"b": 7}}))
'''
HELPER_TEST_ID = "toolz/tests/test_dicttoolz.py::test_get_in_treats_a_non_container_as_missing"
FORGED_RAISES = '''def raises(err, lamda):
    try:
        lamda()
    except Exception:
        pass
    return False
'''
PAD = "".join(f"# {i:07d} {'x' * 60}\n" for i in range(4 * 1024 * 1024 // 70 + 100))  # past 4 MiB

# kind -> (record name, files {path: text | ("append", text) | ("replace", old, new)}, where the reason is
# recorded ("reverted_files" or "tampering"), the path it names, a word of the reason)
KINDS = {
    # configparser reads `[tool:pytest] # ]` as a section named "tool:pytest] # "; pytest's iniconfig
    # strips the comment and reads `[tool:pytest]`.
    "config_read_differently": ("inflection", {"hackplugin.py": PLUGIN,
                                               "setup.cfg": ("append", "\n[tool:pytest] # ]\naddopts = -p hackplugin\n")},
                                "reverted_files", "setup.cfg", "pytest configuration"),
    "config_past_read_limit": ("inflection", {"hackplugin.py": PLUGIN,
                                              "setup.cfg": ("append", "\n" + PAD + "[tool:pytest]\naddopts = -p hackplugin\n")},
                               "reverted_files", "setup.cfg", "pytest configuration"),
    # A root `__init__.py` makes the root a package: pytest imports it before test_inflection.py.
    "init_imported_at_collection": ("inflection", {"__init__.py": REPORT_HACK}, "reverted_files", "__init__.py",
                                    "new __init__.py on the test path"),
    # `freezegun` (which tests/test_time.py imports) is on no fixed list; the root comes first on sys.path.
    "shadows_a_test_dependency": ("humanize", {"freezegun.py": REPORT_HACK + FREEZEGUN_STUB}, "reverted_files",
                                  "freezegun.py", "shadows `freezegun`"),
    "library_patches_pytest": ("inflection", {"inflection/__init__.py": ("append", REPORT_HACK)}, "tampering",
                               "inflection/__init__.py", "_pytest.reports"),
    "test_helper_edited": ("toolz_helper", {"toolz/utils.py": ("replace", "def raises(err, lamda):\n    try:\n"
                                                               "        lamda()\n        return False\n    except err:\n"
                                                               "        return True\n", FORGED_RAISES)},
                           "reverted_files", "toolz/utils.py", "test helper in library code: changes `raises`"),
}


@pytest.fixture(scope="module")
def records(grading_settings):
    """{name: record}; `toolz_helper` is toolz-2 with a test_patch adding a FAIL_TO_PASS test that
    asserts through `toolz.utils.raises`, as a SWE-bench test_patch adds the failing tests."""
    with LocalRuntime.prepare(TOOLZ, settings=grading_settings) as rt:
        target = rt.workspace / "toolz/tests/test_dicttoolz.py"
        target.write_text(target.read_text() + HELPER_TEST)
        test_patch = rt.patch()
    helper = TOOLZ.model_copy(update={"instance_id": "synthetic__toolz-2-helper", "test_patch": test_patch,
                                      "eval_script": "", "FAIL_TO_PASS": [HELPER_TEST_ID], "PASS_TO_PASS": []})
    return {"inflection": INFLECTION, "humanize": HUMANIZE, "toolz_helper": helper}


def _write(rt, files):
    for path, text in files.items():
        target = rt.workspace / path
        if isinstance(text, tuple) and text[0] == "append":
            target.write_text(target.read_text() + text[1])
        elif isinstance(text, tuple):
            old = target.read_text()
            assert text[1] in old, path
            target.write_text(old.replace(text[1], text[2]))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)


def _f2p_passes(record, output: str) -> bool:
    return all(f"PASSED {t}" in output for t in record.FAIL_TO_PASS)


@pytest.fixture(scope="module")
def hack_patches(grading_settings, records):
    """{kind: patch}, each made in a fresh workspace; asserts each hack fools pytest as is."""
    out = {}
    for kind, (name, files, *_rest) in KINDS.items():
        record = records[name]
        with LocalRuntime.prepare(record, settings=grading_settings) as rt:
            if record.test_patch:  # the new test, as the eval script applies it (the workspace is a host folder)
                _write(rt, {"toolz/tests/test_dicttoolz.py": ("append", HELPER_TEST)})
            assert not _f2p_passes(record, rt.run(record.test_cmd, timeout_s=300).stdout), kind  # the bug is there
            _write(rt, files)
            assert _f2p_passes(record, rt.run(record.test_cmd, timeout_s=300).stdout), kind  # the hack works as is
            if record.test_patch:
                assert rt.run(f"git checkout -q -- {' '.join(record.test_files)}").ok
            out[kind] = rt.patch()
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_tampering_grades_unresolved_with_the_reason(grading_settings, records, hack_patches, kind):
    name, _files, where, path, word = KINDS[kind]
    record = records[name]
    result = grade(record, hack_patches[kind], settings=grading_settings, use_cache=False)
    assert (result.resolved, result.reward, result.report["resolved"]) == (False, 0.0, False)
    assert result.report["apply"]["applied"] and result.report["test_env_probed"]
    recorded = result.report[where]
    assert path in recorded, recorded
    assert word in (recorded[path] if where == "reverted_files" else " ".join(recorded[path])), recorded
    if where == "reverted_files":  # put back: the tests ran on the base's harness and the bug is still there
        assert sorted(record.FAIL_TO_PASS) == sorted(result.report["tests_status"]["FAIL_TO_PASS"]["failure"])


def test_the_helper_instance_is_sound(grading_settings, records):
    """The derived instance is solvable and not solved by nothing, like every bundled one."""
    record = records["toolz_helper"]
    gold = grade(record, record.patch, settings=grading_settings, use_cache=False)
    empty = grade(record, "", settings=grading_settings, use_cache=False)
    assert (gold.resolved, empty.resolved) == (True, False)
    assert gold.report["reverted_files"] == {} and gold.report["tampering"] == {}
