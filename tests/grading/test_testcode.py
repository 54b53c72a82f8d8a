"""The test-code rule of `app.grading.testcode` on small git trees in real projects' layouts.

Each tree is a real git repository (the rule reads the base from git, the applied tree from disk), laid
out as the project it is named after; the patch is written into a copy.  End-to-end grades of the same
kinds run in test_grader_layouts.py (a built repository) and tests/tasksets/test_layouts.py (real sdists).
"""
from __future__ import annotations

import subprocess

import pytest

from app.grading import imports, testcode
from app.grading.surface import EnvNames, Trees

GIT_ENV = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1", "PATH": "/usr/bin:/bin"}
UNPROBED = EnvNames.fallback()


def _repo(root, files):
    root.mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base"]):
        subprocess.run(cmd, cwd=root, check=True, env=GIT_ENV)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def judge(tmp_path, files, protected, changes, env=UNPROBED, test_patch_added=None):
    """(verdict, layout) for `changes` {path: new text} on a base of `files` with `protected` test files."""
    base = tmp_path / "base"
    commit = _repo(base, files)
    tree = tmp_path / "tree"
    subprocess.run(["cp", "-a", str(base), str(tree)], check=True)
    for path, text in changes.items():
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_text(text)
    trees = Trees.scan(base, commit, tree, protected)
    layout = testcode.Layout.read(trees, env, "/testbed")
    return testcode.judge(layout, set(changes), test_patch_added or {}), layout


EDIT = "# changed\n"


def test_library_under_a_test_folder_is_kept_and_the_helper_beside_the_tests_is_not(tmp_path):
    """cachetools' layout: `src/cachetools/test/utils.py` ships with the package; `tests/helpers.py` is the tests'."""
    files = {"src/cachetools/__init__.py": "", "src/cachetools/test/__init__.py": "",
             "src/cachetools/test/utils.py": "class FakeTimer:\n    pass\n", "tests/__init__.py": "",
             "tests/helpers.py": "def assert_clock(t, n):\n    assert t() == n\n",
             "tests/test_timer.py": "from cachetools.test.utils import FakeTimer\nfrom tests.helpers import assert_clock\n"}
    env = EnvNames(frozenset({"cachetools"}), ("/testbed/src",), True, frozenset({"cachetools"}))
    verdict, layout = judge(tmp_path, files, {"tests/test_timer.py"},
                            {"src/cachetools/test/utils.py": EDIT, "tests/helpers.py": EDIT}, env)
    assert list(verdict.reverted) == ["tests/helpers.py"]
    assert "in the test directory tests" in verdict.reverted["tests/helpers.py"]
    assert verdict.kept["src/cachetools/test/utils.py"].startswith("library code: part of `cachetools`, imported from src")
    assert layout.summary()["decided"] and layout.summary()["test_dirs"] == ["tests"]


def test_django_test_utils_is_library(tmp_path):
    files = {"django/__init__.py": "", "django/test/__init__.py": "from django.test.utils import override\n",
             "django/test/utils.py": "def override():\n    pass\n", "tests/runtests.py": "",
             "tests/test_utils/tests.py": "", "tests/test_utils/test_override.py": "from django.test.utils import override\n"}
    verdict, _ = judge(tmp_path, files, {"tests/test_utils/test_override.py"}, {"django/test/utils.py": EDIT})
    assert verdict.reverted == {} and "django/test/utils.py" in verdict.kept


def test_pytest_python_files_config_and_a_src_fixtures_module(tmp_path):
    """pytest's own layout: `src/_pytest/fixtures.py`, tests in `testing/` collected by `testing/python/*.py`."""
    files = {"pyproject.toml": '[tool.pytest.ini_options]\npython_files = ["test_*.py", "testing/python/*.py"]\n',
             "src/_pytest/__init__.py": "", "src/_pytest/fixtures.py": "def fixture():\n    pass\n",
             "src/_pytest/python.py": "from _pytest.fixtures import fixture\n",
             "testing/python/fixtures.py": "from _pytest.fixtures import fixture\n",
             "testing/python/util.py": "X = 1\n", "testing/test_main.py": "from util import X\n"}
    verdict, layout = judge(tmp_path, files, {"testing/python/fixtures.py"},
                            {"src/_pytest/fixtures.py": EDIT})
    assert layout.trees.collected >= {"testing/python/fixtures.py", "testing/python/util.py", "testing/test_main.py"}
    assert verdict.reverted == {} and verdict.kept["src/_pytest/fixtures.py"].startswith("library code")
    assert testcode.collected_reason(layout.trees, "testing/python/new_case.py").startswith("collected test file")
    assert testcode.collected_reason(layout.trees, "src/_pytest/new.py") is None


def test_a_helper_inside_the_package_test_folder_is_test_support(tmp_path):
    """tornado's layout: `tornado/testing.py` is library, `tornado/test/util.py` the tests' helper."""
    files = {"tornado/__init__.py": "", "tornado/testing.py": "def gen_test(f):\n    return f\n",
             "tornado/ioloop.py": "", "tornado/test/__init__.py": "",
             "tornado/test/util.py": "def skip_if_windows(f):\n    return f\n",
             "tornado/test/testing_test.py": "from tornado.testing import gen_test\nfrom tornado.test.util import skip_if_windows\n"}
    verdict, _ = judge(tmp_path, files, {"tornado/test/testing_test.py"},
                       {"tornado/testing.py": EDIT, "tornado/test/util.py": EDIT})
    assert list(verdict.reverted) == ["tornado/test/util.py"] and list(verdict.kept) == ["tornado/testing.py"]


def test_a_module_in_a_test_folder_that_library_code_imports_is_library(tmp_path):
    files = {"pkg/__init__.py": "from pkg.tests.shared import DEFAULTS\n", "pkg/tests/__init__.py": "",
             "pkg/tests/shared.py": "DEFAULTS = {}\n", "pkg/tests/test_a.py": "from pkg.tests.shared import DEFAULTS\n"}
    verdict, _ = judge(tmp_path, files, {"pkg/tests/test_a.py"}, {"pkg/tests/shared.py": EDIT})
    assert verdict.kept == {"pkg/tests/shared.py": "library code: imported by library module pkg/__init__.py"}
    assert verdict.reverted == {}


def test_a_tests_package_is_test_code_all_through(tmp_path):
    files = {"tests/__init__.py": "", "tests/support.py": "X = 1\n", "tests/unit/__init__.py": "",
             "tests/unit/test_a.py": "from tests.support import X\n", "lib/__init__.py": ""}
    verdict, _ = judge(tmp_path, files, {"tests/unit/test_a.py"}, {"tests/support.py": EDIT})
    assert "in the test directory tests" in verdict.reverted["tests/support.py"]


def test_a_one_module_distribution_beside_its_tests(tmp_path):
    """`six.py` and `test_six.py` at the root: library when an installed distribution provides `six`."""
    files = {"six.py": "def b(s):\n    return s\n", "helpers.py": "Y = 1\n",
             "test_six.py": "import six\nfrom helpers import Y\n"}
    env = EnvNames(frozenset({"six"}), (), True, frozenset({"six"}))
    verdict, _ = judge(tmp_path, files, {"test_six.py"}, {"six.py": EDIT, "helpers.py": EDIT}, env)
    assert list(verdict.kept) == ["six.py"] and list(verdict.reverted) == ["helpers.py"]
    # Without a probe the name decides, conservatively.
    verdict, _ = judge(tmp_path / "unprobed", files, {"test_six.py"}, {"six.py": EDIT, "helpers.py": EDIT})
    assert sorted(verdict.kept) == ["helpers.py", "six.py"]


def test_an_undecided_layout_uses_the_conservative_rule_and_says_so(tmp_path):
    """pytest's patterns collect no test file: the instance's tests are Django-style `tests.py` modules."""
    files = {"pkg/__init__.py": "", "pkg/testing.py": "def check(x):\n    assert x\n", "pkg/core.py": "X = 1\n"}
    files["tests/tests.py"] = "from pkg.testing import check\nfrom pkg.core import X\n"
    verdict, layout = judge(tmp_path, files, {"tests/tests.py"}, {"pkg/testing.py": EDIT, "pkg/core.py": EDIT})
    assert not layout.decided and layout.summary()["rule"] == testcode.UNDECIDED
    assert "undecided layout" in verdict.reverted["pkg/testing.py"]
    assert "undecided layout" in verdict.kept["pkg/core.py"]


CHECKS = "def raises(err, fn):\n    try:\n        fn()\n    except err:\n        return True\n    return False\n"


@pytest.mark.parametrize("module,extra,put_back", [
    ("pkg/utils.py", "", True),                       # a checker hiding in library code (toolz.utils.raises)
    ("pkg/utils.py", "__all__ = ['raises']\n", False),  # exported: the package's API
    ("pkg/testing.py", "", False),                    # a testing API the package ships (pint.testing)
])
def test_checkers_in_library_code(tmp_path, module, extra, put_back):
    files = {"pkg/__init__.py": "", module: CHECKS + extra, "pkg/tests/__init__.py": "",
             "pkg/tests/test_a.py": f"from {module[:-3].replace('/', '.')} import raises\n"}
    changed = {module: (CHECKS + extra).replace("    return False\n", "    return True\n")}
    verdict, _ = judge(tmp_path, files, {"pkg/tests/test_a.py"}, changed)
    assert (module in verdict.reverted) == put_back, verdict
    if put_back:
        assert verdict.reverted[module].startswith("test helper in library code: changes `raises`")
    else:
        assert verdict.kept[module].startswith("library code")


def test_test_patch_imports_count(tmp_path):
    files = {"tests/helpers_top.py": "X = 1\n", "tests/test_x.py": "", "test_root.py": "def test_r():\n    pass\n"}
    added = imports.test_patch_additions(
        "diff --git a/test_root.py b/test_root.py\n--- a/test_root.py\n+++ b/test_root.py\n@@ -1,2 +1,3 @@\n"
        "+from tests.helpers_top import X\n def test_r():\n     pass\n")
    assert added == {"test_root.py": "from tests.helpers_top import X\n"}
    verdict, _ = judge(tmp_path, files, {"test_root.py"}, {"tests/helpers_top.py": "X = 3\n"}, test_patch_added=added)
    assert "tests/helpers_top.py" in verdict.reverted


@pytest.mark.parametrize("path,expect", [
    ("django/test/utils.py", True), ("sympy/testing/pytest.py", True), ("pkg/fixtures.py", True),
    ("tests/helpers.py", True), ("pkg/core.py", False), ("contest.py", False),
])
def test_the_conservative_rule_reads_names(path, expect):
    assert testcode.is_testish(path) is expect
