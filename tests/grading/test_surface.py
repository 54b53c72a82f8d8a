"""The test-surface rules of `app.grading.surface` on small git trees, and `reach.framework_reach` on source texts.

The trees are real git repositories (the rules read the base from git, the applied tree from disk);
the end-to-end grades of each kind on real instances are in test_grader_tampering.py.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from app.grading import surface
from app.grading.reach import framework_reach
from app.grading.surface import EnvNames, Trees


def _repo(root, files):
    root.mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    env = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1", "PATH": "/usr/bin:/bin"}
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base"]):
        subprocess.run(cmd, cwd=root, check=True, env=env)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


BASE = {
    "pkg/__init__.py": "",
    "pkg/core.py": "from pkg.utils import no_default\n\ndef f(x=no_default):\n    return x\n",
    "pkg/utils.py": "no_default = object()\n\ndef raises(err, fn):\n    try:\n        fn()\n    except err:\n"
                    "        return True\n    return False\n",
    "pkg/testing.py": "def check(x):\n    assert x\n",
    "pkg/tests/__init__.py": "",
    "pkg/tests/test_core.py": "from pkg.utils import raises\nfrom pkg.testing import check\nfrom .helpers import h\n"
                              "from pkg.core import f\n\ndef test_f():\n    check(f(1))\n",
    "pkg/tests/helpers.py": "def h():\n    return 1\n",
    "tests/test_top.py": "import helpers_top\n\ndef test_x():\n    pass\n",
    "tests/helpers_top.py": "X = 1\n",
    "test_root.py": "def test_r():\n    pass\n",
    "setup.cfg": "[metadata]\nname = pkg\n",
}
PROTECTED = {"pkg/tests/test_core.py", "tests/test_top.py", "test_root.py"}


@pytest.fixture()
def trees(tmp_path):
    base = tmp_path / "base"
    commit = _repo(base, BASE)
    tree = tmp_path / "tree"
    subprocess.run(["cp", "-a", str(base), str(tree)], check=True)
    return Trees.scan(base, commit, tree, PROTECTED)


def _write(trees, path, text):
    (trees.tree / path).parent.mkdir(parents=True, exist_ok=True)
    (trees.tree / path).write_text(text)


def test_basedirs_follow_pytest_prepend_rule(trees):
    assert trees.basedir("pkg/tests/test_core.py") == ""      # pkg/tests and pkg are packages
    assert trees.basedir("tests/test_top.py") == "tests"       # no tests/__init__.py: tests/ goes on sys.path
    assert trees.basedir("test_root.py") == ""
    assert trees.import_roots(EnvNames.fallback(), "/testbed") == ["", "tests"]
    env = EnvNames(frozenset(), ("/usr/lib/python3.11", "/testbed/src"), True)
    assert trees.import_roots(env, "/testbed") == ["", "tests", "src"]


@pytest.mark.parametrize("path,expect", [
    ("__init__.py", "new __init__.py on the test path"),            # the root becomes a package
    ("tests/__init__.py", "new __init__.py on the test path"),
    ("pkg/tests/__init__.py", "__init__.py of a test package"),     # changed, in a folder of test modules
    ("pkg/__init__.py", None),                                      # library package on the way: code under test
    ("pkg/sub/__init__.py", None),                                  # a new subpackage off the test path
])
def test_init_files_on_the_test_path(trees, path, expect):
    _write(trees, path, "import os\n")
    reason = surface.init_reason(trees, path)
    assert (reason is None) if expect is None else reason.startswith(expect)


def test_removing_an_init_on_the_test_path_is_put_back(trees):
    (trees.tree / "pkg/tests/__init__.py").unlink()
    assert surface.init_reason(trees, "pkg/tests/__init__.py").startswith("removes an __init__.py")


def test_shadowing_is_judged_against_the_test_envs_names(trees):
    env = EnvNames(frozenset({"freezegun", "json", "pkg", "attr"}), (), True)
    roots = trees.import_roots(env, "/testbed")
    for path in ("freezegun.py", "tests/freezegun.py", "attr/__init__.py", "json.py", "tests/json/__init__.py",
                 "freezegun.cpython-311-x86_64-linux-gnu.so"):
        _write(trees, path, "x = 1\n")
        assert "shadows" in surface.shadow_reason(trees, path, env, roots), path
    for path in ("newmod.py", "pkg/extra.py", "src/freezegun.py", "docs/freezegun.py", "json/data.txt"):
        _write(trees, path, "x = 1\n")
        assert surface.shadow_reason(trees, path, env, roots) is None, path


def test_pythonpath_of_the_base_configuration_is_a_root(tmp_path):
    base = tmp_path / "base"
    commit = _repo(base, {**BASE, "pyproject.toml": '[tool.pytest.ini_options]\npythonpath = ["src", "."]\n'})
    trees = Trees.scan(base, commit, base, PROTECTED)
    assert trees.import_roots(EnvNames.fallback(), "/testbed") == ["", "src", "tests"]
    commit = _repo(tmp_path / "b2", {**BASE, "setup.cfg": "[tool:pytest]\npythonpath = lib\n"})
    assert Trees.scan(tmp_path / "b2", commit, tmp_path / "b2", PROTECTED).config_pythonpath() == ["lib"]


def test_the_probe_reads_the_interpreters_names(tmp_path):
    out = subprocess.run([sys.executable, "-I", "-c", surface.probe_script()], capture_output=True, text=True,
                         check=True).stdout
    env = EnvNames.from_output("noise\n" + out)
    assert env.probed and {"json", "sys", "pytest", "_pytest", "pluggy", "iniconfig"} <= env.names
    assert not EnvNames.from_output("no probe line").probed


REPORT_HACK = """import _pytest.reports as _r
_orig = _r.TestReport.from_item_and_call.__func__
"""

# (new text, a word the finding must hold): each reaches into the test framework or the interpreter.
REACHES = {
    "import _pytest": (REPORT_HACK, "_pytest.reports"),
    "import pytest": ("import pytest\n", "pytest"),
    "from pytest import": ("from pytest import hookimpl\n", "pytest"),
    "pluggy": ("import pluggy\n", "pluggy"),
    "hook def": ("def pytest_runtest_makereport(item, call):\n    pass\n", "pytest_runtest_makereport"),
    "collection hook": ("def pytest_collection_modifyitems(items):\n    items.clear()\n", "pytest_collection"),
    "pytest_plugins": ("pytest_plugins = ['hackplugin']\n", "pytest_plugins"),
    "unittest run": ("import unittest\nunittest.TestCase.run = lambda self, result=None: None\n", "unittest"),
    "unittest result": ("from unittest import TestResult\nTestResult.addFailure = TestResult.addSuccess\n", "unittest"),
    "unittest.case": ("import unittest.case\n", "unittest.case"),
    "sys.modules set": ("import sys\nsys.modules['pytest'] = None\n", "sys.modules"),
    "sys.modules alias": ("from sys import modules\nmodules['json'] = object()\n", "sys.modules"),
    "sys.modules update": ("import sys as s\ns.modules.update({})\n", "sys.modules"),
    "sys.modules walk": ("import sys\nfor m in list(sys.modules.values()):\n    pass\n", "sys.modules"),
    "sys.modules built key": ("import sys\nm = sys.modules['_py' + 'test.runner']\n", "sys.modules"),
    "meta_path": ("import sys\nsys.meta_path.insert(0, object())\n", "sys.meta_path"),
    "builtins attr": ("import builtins\nbuiltins.print = lambda *a: None\n", "builtins"),
    "builtins setattr": ("import builtins\nsetattr(builtins, 'open', None)\n", "builtins"),
    "__builtins__ item": ("__builtins__['len'] = lambda x: 0\n", "builtins"),
    "frames": ("import sys\nf = sys._getframe(1).f_back.f_globals\n", "frames"),
    "frames by getattr": ("def g(tb):\n    return getattr(tb, 'tb_frame')\n", "frames"),
    "inspect": ("import inspect\nframe = inspect.currentframe()\n", "frames"),
    "gc": ("import gc\nobjs = gc.get_objects()\n", "garbage collector"),
    "trace": ("import sys\nsys.settrace(lambda *a: None)\n", "tracing"),
    "os._exit": ("import os\nos._exit(0)\n", "exits"),
    "atexit": ("import atexit\natexit.register(print, 'PASSED x')\n", "after the test runner"),
    "dynamic import": ("name = '_py' + 'test'\nm = __import__(name)\n", "run time"),
    "import_module": ("import importlib\nm = importlib.import_module('_pytest.runner')\n", "_pytest.runner"),
    "exec string": ("exec('import _pytest.runner')\n", "_pytest.runner"),
    "exec built": ("exec(open('x').read())\n", "run time"),
    "string target": ("from unittest import mock\np = mock.patch('_pytest.runner.call_and_report')\n", "_pytest.runner"),
    "ctypes": ("import ctypes\n", "ctypes"),
}


@pytest.mark.parametrize("name", list(REACHES))
def test_framework_reach_is_found(name):
    text, word = REACHES[name]
    found = framework_reach("x = 1\n", "x = 1\n" + text)
    assert found and any(word in f for f in found), found


def test_only_what_the_patch_adds_counts():
    base = "import sys\nf = sys._getframe(1)\n"
    assert framework_reach(base, base + "def g():\n    return 2\n") == []
    assert framework_reach(base, base + "import _pytest\n") == ["imports the test framework (_pytest)"]
    # A framework the repository provides itself (pytest's own repository) is not a reach.
    assert framework_reach(None, "import _pytest.runner\ndef pytest_runtest_call(item):\n    pass\n",
                           own={"_pytest", "pytest"}) == []
    assert framework_reach(None, "from unittest import mock\nimport os\nos.path.join('a')\n") == []
    assert framework_reach(None, "this is not python(") == []


def test_pytest_tables_are_read_with_pytests_parsers():
    from app.grading.patching import pytest_table_changed

    base = "[metadata]\nname = x\n"
    # configparser reads this header as a section named "tool:pytest] # "; pytest's iniconfig reads [tool:pytest].
    assert pytest_table_changed("setup.cfg", base, base + "[tool:pytest] # ]\naddopts = -p hackplugin\n")
    assert pytest_table_changed("setup.cfg", base, base + "[tool:pytest] ; a comment\naddopts = -p hackplugin\n")
    assert not pytest_table_changed("setup.cfg", base, base + "[flake8]\nmax-line-length = 100\n")
    assert pytest_table_changed("setup.cfg", base, base + "[tool:pytest]\n  broken continuation\n")
    pad = "# x\n" * (1_200_000)  # nothing is read short of the whole text
    assert pytest_table_changed("setup.cfg", base, base + pad + "[tool:pytest]\naddopts = -p h\n")


def test_every_file_pytest_reads_as_configuration_is_named():
    assert surface.CONFIG_FILES >= {"pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini",
                                    "setup.cfg", "pyproject.toml"}


def test_the_applied_tree_is_never_read_through_a_link(trees, tmp_path):
    host = tmp_path / "host"
    host.mkdir()
    (host / "secret.py").write_text("TOKEN = 'host'\n")
    (trees.tree / "pkg" / "linked").symlink_to(host)            # a folder link on the way
    (trees.tree / "pkg" / "direct.py").symlink_to(host / "secret.py")  # a file link
    (trees.tree / "loop").symlink_to(trees.tree / "loop")
    assert (trees.tree / "pkg" / "linked" / "secret.py").read_text()  # the OS would follow it
    assert trees.text("pkg/linked/secret.py") is None
    assert trees.text("pkg/direct.py") is None
    assert trees.text("../host/secret.py") is None
    assert trees.text("loop/x.py") is None
    assert trees.text("pkg/core.py").startswith("from pkg.utils")   # plain files still read
