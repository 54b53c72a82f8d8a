"""Reading agent patches (unidiff), the test-harness filter and the apply script: no runtime needed."""
from __future__ import annotations

import subprocess

import pytest

from app.grading.outcome import grade_log_path, missing_tests
from app.grading.steps import apply_failure_reason
from app.grading.patching import (
    PatchReadError,
    apply_script,
    drop_test_changes,
    pytest_table_changed,
    read_patch,
    harness_change_reason,
)
from app.runtimes.paths import RuntimePaths
from app.tasksets import load_task_set


def _modify(path: str, prefix: tuple[str, str] = ("a/", "b/")) -> str:
    a, b = prefix
    return (f"diff --git {a}{path} {b}{path}\n--- {a}{path}\n+++ {b}{path}\n"
            "@@ -1,2 +1,2 @@\n context\n-old\n+new\n")


LIBRARY_IN_TEST_FOLDERS = ["django/test/utils.py", "sympy/testing/runtests.py",
                           "numpy/testing/_private/utils.py", "lib/matplotlib/testing/decorators.py"]


def test_library_code_under_test_folders_is_kept():
    patch = "".join(_modify(p) for p in LIBRARY_IN_TEST_FOLDERS)
    kept, dropped = drop_test_changes(patch, test_files=["tests/test_utils.py"])
    assert kept == patch and dropped == []


def test_the_instances_tests_and_the_test_harness_are_dropped():
    harness = {
        "tests/test_utils.py": "instance test file",          # the record's test_files
        "tests/helpers_for_f2p.py": "instance test file",     # named by a FAIL_TO_PASS id
        "pkg/conftest.py": "test module",
        "pkg/tests/test_new.py": "test module",
        "pkg/core_test.py": "test module",
        "pytest.ini": "pytest configuration",
        "tests/.pytest.ini": "pytest configuration",
        "tox.ini": "pytest configuration",
        "pytest.toml": "pytest configuration",
        "sitecustomize.py": "interpreter start-up hook",
        "src/usercustomize.py": "interpreter start-up hook",
        "hack.pth": "interpreter start-up hook",
        "hack-1.0.dist-info/entry_points.txt": "package metadata (entry points)",
        "hack.egg-info/entry_points.txt": "package metadata (entry points)",
        "pkg/__pycache__/core.cpython-311.pyc": "compiled bytecode",
    }
    protected = {"tests/test_utils.py", "tests/helpers_for_f2p.py"}
    for path, reason in harness.items():
        assert harness_change_reason(path, protected) == reason, path
    for path in [*LIBRARY_IN_TEST_FOLDERS, "setup.cfg", "pyproject.toml", "pkg/testing.py", "tests/__init__.py"]:
        assert harness_change_reason(path, protected) is None, path
    patch = "".join(_modify(p) for p in harness) + _modify("pkg/core.py")
    kept, dropped = drop_test_changes(patch, ["tests/test_utils.py"], "",
                                      ["tests/helpers_for_f2p.py::test_x[a]", "not a pytest id"])
    assert kept == _modify("pkg/core.py") and dropped == sorted(harness)


def test_test_patch_files_are_protected_in_any_patch_format():
    test_patch = _modify("tests/check_things.py")
    kept, dropped = drop_test_changes(_modify("tests/check_things.py", ("", "")), [], test_patch)
    assert (kept, dropped) == ("", ["tests/check_things.py"])


def test_paths_are_read_as_they_will_be_applied():
    # git's a/ b/ prefixes are stripped (-p1) ...
    git_style = _modify("pkg/core.py")
    assert read_patch(git_style).strip == 1 and read_patch(git_style).files[0].paths == ("pkg/core.py",)
    # ... `git diff --no-prefix` names the real path: read and applied with -p0, so a conftest
    # under tests/ is seen as tests/conftest.py (git apply -p1 would have put it at the root).
    no_prefix = ("diff --git tests/conftest.py tests/conftest.py\nnew file mode 100644\n--- /dev/null\n"
                 "+++ tests/conftest.py\n@@ -0,0 +1 @@\n+import pytest\n")
    read = read_patch(no_prefix)
    assert read.strip == 0 and read.files[0].paths == ("tests/conftest.py",)
    assert drop_test_changes(no_prefix, []) == ("", ["tests/conftest.py"])
    # A plain `diff -u` without git headers: both names are classified.
    plain = "--- conftest.py.orig\n+++ conftest.py\n@@ -0,0 +1 @@\n+import pytest\n"
    assert read_patch(plain).files[0].paths == ("conftest.py.orig", "conftest.py")
    assert drop_test_changes(plain, []) == ("", ["conftest.py", "conftest.py.orig"])
    # A removed line that starts with "--" followed by one starting with "++" is hunk content, not a header.
    tricky = "--- a/x.py\n+++ b/x.py\n@@ -1,2 +1,2 @@\n--- a/conftest.py\n+++ b/conftest.py\n x\n"
    assert [f.paths for f in read_patch(tricky).files] == [("x.py",)]


@pytest.mark.parametrize("patch,message", [
    ("this is not a diff\n", "holds no file change"),
    (_modify("x.py") + _modify("y.py", ("", "")), "mixes git-prefixed"),
    (_modify("../outside.py"), "not a relative path inside the repository"),
    (_modify(".git/config"), "not a relative path inside the repository"),
    ("--- /etc/passwd\n+++ /etc/passwd\n@@ -1 +1 @@\n-a\n+b\n", "not a relative path"),
    ("--- a/x.py\n+++ b/x.py\n@@ -1,3 +1,3 @@\n-a\n+b\n", "cannot be parsed"),
])
def test_a_patch_whose_paths_cannot_be_read_is_refused(patch, message):
    with pytest.raises(PatchReadError, match=message):
        read_patch(patch)


def test_apply_script_uses_the_strip_level_paths_were_read_with(tmp_path):
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "mod.py").write_text("context\nold\n")
    env = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1", "PATH": "/usr/bin:/bin"}
    for cmd in (["git", "init", "-q"], ["git", "add", "."],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base"]):
        subprocess.run(cmd, cwd=repo, check=True, env=env)
    patch = _modify("tests/mod.py", ("", ""))
    (tmp_path / "p.diff").write_text(patch)
    (tmp_path / "apply.sh").write_text(apply_script(str(tmp_path / "p.diff"), read_patch(patch).strip))
    res = subprocess.run(["bash", str(tmp_path / "apply.sh")], cwd=repo, capture_output=True, text=True, env=env)
    assert res.returncode == 0 and ">>>>> Applied Patch (git apply --verbose -p0)" in res.stdout
    assert (repo / "tests" / "mod.py").read_text() == "context\nnew\n"


def test_pytest_tables_of_setup_cfg_and_pyproject_are_compared():
    base_cfg = "[metadata]\nname = x\n\n[tool:pytest]\ntestpaths = tests\n"
    assert not pytest_table_changed("setup.cfg", base_cfg, base_cfg.replace("name = x", "name = y"))
    assert pytest_table_changed("setup.cfg", base_cfg, base_cfg + "addopts = -p hackplugin\n")
    assert pytest_table_changed("setup.cfg", None, "[tool:pytest]\naddopts = -p hackplugin\n")
    base_toml = '[project]\nname = "x"\n'
    assert not pytest_table_changed("pyproject.toml", base_toml, base_toml + 'version = "2"\n')
    assert pytest_table_changed("pyproject.toml", base_toml, base_toml + '[tool.pytest.ini_options]\naddopts = "-p h"\n')
    assert pytest_table_changed("pyproject.toml", None, '[tool.pytest]\naddopts = ["-p", "h"]\n')
    assert pytest_table_changed("pyproject.toml", base_toml, "not = [toml")  # unreadable counts as changed


def test_apply_failure_reason_leads_with_a_summary_and_the_log(tmp_path):
    output = ("Checking patch inflection/__init__.py...\nerror: while searching for:\nunrelated context one\n"
              "error: patch failed: inflection/__init__.py:10\nerror: inflection/__init__.py: patch does not apply\n"
              + "x" * 5000 + "\n1 out of 1 hunk FAILED -- saving rejects to file inflection/__init__.py.rej\n"
              ">>>>> Patch Apply Failed\n")
    reason = apply_failure_reason(1, output, tmp_path / "g.log")
    first, *rest = reason.splitlines()
    assert first.startswith("patch did not apply with any of the 4 methods") and str(tmp_path / "g.log") in first
    assert rest[:3] == ["error: while searching for:", "error: patch failed: inflection/__init__.py:10",
                        "error: inflection/__init__.py: patch does not apply"]
    assert rest[3].startswith("1 out of 1 hunk FAILED") and "xxxx" not in reason


def test_every_grade_gets_its_own_log_path(tmp_path):
    paths = RuntimePaths(var_dir=tmp_path / "var", cache_dir=tmp_path / "cache")
    record = load_task_set("synthetic").get("synthetic__inflection-2")
    other = record.model_copy(update={"FAIL_TO_PASS": record.FAIL_TO_PASS[:1]})  # same id, another record
    logs = [grade_log_path(paths, r, "") for r in (record, record, other)]
    assert len(set(logs)) == 3 and all(p.parent == paths.grading_logs / record.instance_id for p in logs)
    hostile = record.model_copy(update={"instance_id": "../../etc/x"})
    assert grade_log_path(paths, hostile, "").resolve().is_relative_to(paths.grading_logs.resolve())


def test_ids_absent_from_the_log_are_reported_apart(tmp_path):
    from app.tasksets.swebench_compat import make_test_spec

    record = load_task_set("synthetic").get("synthetic__inflection-2")
    ran, never = record.FAIL_TO_PASS[0], record.FAIL_TO_PASS[1]
    log = tmp_path / "g.log"
    log.write_text(">>>>> Start Test Output\n"
                   + "".join(f"PASSED {t}\n" for t in record.PASS_TO_PASS)
                   + f"FAILED {ran} - AssertionError\n>>>>> End Test Output\n>>>>> Test Exit Code: 1\n")
    missing = missing_tests(record, make_test_spec(record), log)
    assert missing == {"FAIL_TO_PASS": [t for t in record.FAIL_TO_PASS if t != ran], "PASS_TO_PASS": []}
    assert never in missing["FAIL_TO_PASS"]
