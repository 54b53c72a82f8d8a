"""The trees a grade compares and the rules of pytest's import machinery: what of an applied patch the test run would load.

`patching.harness_change_reason` judges a path by its name alone.  This module judges the
applied tree against the base tree, the instance's test files and the test environment:

* **configuration**: every file pytest reads as configuration (`pytest.ini`, `.pytest.ini`,
  `pytest.toml`, `.pytest.toml`, `tox.ini`, `setup.cfg`, `pyproject.toml`, at any depth,
  since pytest looks for them from the common ancestor of its arguments upward:
  https://docs.pytest.org/en/stable/reference/customize.html#finding-the-rootdir) is put back
  whole when the patch touches it.  Nothing is parsed, so no parser difference (a comment in a
  section header, a table past a read limit, a second section of the same name) can matter.
* **`__init__.py` on the test path**: with pytest's default `prepend` import mode a test
  file's module name is found by walking up while the folder holds an `__init__.py`, and
  every package on the way is imported before the test module
  (https://docs.pytest.org/en/stable/explanation/pythonpath.html).  An `__init__.py` the
  patch adds to, or removes from, a folder on the way from the rootdir to a test file or a
  `conftest.py` is put back, and so is a changed one in a folder that holds test modules.
* **shadowing**: `python -m pytest` puts the working directory first on `sys.path`, and
  `prepend` inserts each test file's and conftest's base folder (the first one up without an
  `__init__.py`).  A new top-level module or package in one of those folders whose name is
  importable in the test environment (its interpreter's `sys.stdlib_module_names`,
  `sys.builtin_module_names`, every module on its `sys.path`, every top-level name of its
  installed distributions: `probe_script`) replaces that module, and is put back.
* **test code the tests import** (`app.grading.testcode`): test-support modules and test
  helpers in library code, decided by what pytest collects and what only the tests use; library
  code is kept whatever its path looks like.
* **framework reach** (`app.grading.reach`): kept code that newly reaches into the test
  framework or the interpreter grades the patch unresolved.

The import graph these rules walk is `app.grading.imports`.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import sys
from pathlib import Path, PurePosixPath
from typing import Iterable

from app.gitutil import git

CONFIG_FILES = frozenset({"pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini", "setup.cfg",
                          "pyproject.toml"})
PROBE_MARKER = "TURNSTILE-TEST-ENV "
# (CPython's own regression-test package `test` is left out: a root `test/` folder is a common
# place for a project's tests, which pytest imports by path.)
_NOT_SHADOWS = frozenset({"test", "__pycache__", "__main__"})
_SKIP_DIRS = frozenset({".git", "__pycache__", "node_modules", ".tox", ".nox", ".venv", "venv", ".eggs"})


def probe_script() -> str:
    """Python source that prints `PROBE_MARKER` + JSON {stdlib, builtin, path, names} for the
    interpreter it runs in (run it with `python -I`, before the patch is applied)."""
    return r'''
import json, os, pkgutil, sys
names = set(getattr(sys, "stdlib_module_names", ())) | set(sys.builtin_module_names)
for entry in sys.path:
    if not entry or not os.path.isdir(entry):
        continue
    try:
        names.update(m.name for m in pkgutil.iter_modules([entry]))
        names.update(n for n in os.listdir(entry) if n.isidentifier() and os.path.isdir(os.path.join(entry, n)))
    except OSError:
        pass
dists = set()
try:
    import importlib.metadata as md
    dists = set(md.packages_distributions())
    names.update(dists)
except Exception:
    pass
print("''' + PROBE_MARKER + r'''" + json.dumps({"names": sorted(names), "path": sys.path, "dists": sorted(dists),
                                               "version": list(sys.version_info[:3])}))
'''


@dataclasses.dataclass(frozen=True)
class EnvNames:
    """The test environment's importable top-level names and its `sys.path` (paths inside the runtime).

    `probed` is False when the probe could not run: then `names` holds this interpreter's
    standard-library names only."""

    names: frozenset[str]
    path: tuple[str, ...] = ()
    probed: bool = False
    dist_names: frozenset[str] = frozenset()  # top-level names installed distributions provide

    @classmethod
    def fallback(cls) -> "EnvNames":
        return cls(frozenset(sys.stdlib_module_names) | frozenset(sys.builtin_module_names))

    @classmethod
    def from_output(cls, output: str) -> "EnvNames":
        """Read `probe_script`'s output; the fallback when it holds no probe line."""
        for line in reversed(output.splitlines()):
            if line.startswith(PROBE_MARKER):
                try:
                    data = json.loads(line[len(PROBE_MARKER):])
                    names = frozenset(str(n) for n in data["names"]) | cls.fallback().names
                    return cls(names, tuple(str(p) for p in data.get("path", [])), True,
                               frozenset(str(n) for n in data.get("dists", [])))
                except (ValueError, KeyError, TypeError):
                    break
        return cls.fallback()


# --- the trees ----------------------------------------------------------------------------------


DEFAULT_PYTHON_FILES = ("test_*.py", "*_test.py")  # pytest's default `python_files`


def _is_test_module(name: str) -> bool:
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def collects(patterns: Iterable[str], path: str) -> bool:
    """Whether pytest's `python_files` `patterns` match `path` (relative to the rootdir).

    As `_pytest.pathlib.fnmatch_ex`: a pattern without a `/` is matched against the file name,
    one with a `/` against the path, anchored at any folder (`testing/python/*.py`)."""
    for pattern in patterns:
        if "/" not in pattern:
            if fnmatch.fnmatch(PurePosixPath(path).name, pattern):
                return True
        elif fnmatch.fnmatch("/" + path, "*/" + pattern.lstrip("/")):
            return True
    return False


@dataclasses.dataclass
class Trees:
    """The base commit (read from git: `base_repo` at `commit`) and the applied tree (a host path),
    with the base's test layout."""

    base: Path
    commit: str
    tree: Path
    protected: set[str]
    files: set[str] = dataclasses.field(default_factory=set)        # every file of the base commit
    dirs: set[str] = dataclasses.field(default_factory=set)         # every folder of it ("" = the root)
    test_files: set[str] = dataclasses.field(default_factory=set)   # test modules, conftests, protected
    py_files: list[str] = dataclasses.field(default_factory=list)   # every .py file of the base
    collected: set[str] = dataclasses.field(default_factory=set)    # test files pytest collects, protected ones
    python_files: list[str] = dataclasses.field(default_factory=list)  # pytest's `python_files` patterns

    @classmethod
    def scan(cls, base: Path, commit: str, tree: Path, protected: Iterable[str]) -> "Trees":
        """Raises `RuntimeSetupError` when the base commit cannot be listed."""
        t = cls(base, commit, tree, set(protected))
        listing = git(base, "ls-tree", "-r", "-z", "--name-only", commit, stage="grade").stdout
        t.files = {f for f in listing.split("\0") if f}
        t.dirs = {""} | {str(d) for f in t.files for d in PurePosixPath(f).parents if str(d) != "."}
        t.python_files = t.config_patterns("python_files") or list(DEFAULT_PYTHON_FILES)
        for path in sorted(t.files):
            name = PurePosixPath(path).name
            if name.endswith(".py") and not (_SKIP_DIRS & set(PurePosixPath(path).parts[:-1])):
                t.py_files.append(path)
                if _is_test_module(name) or collects(t.python_files, path):
                    t.collected.add(path)
                if name == "conftest.py":
                    t.test_files.add(path)
        t.collected |= {p for p in t.protected if p.endswith(".py") and PurePosixPath(p).name != "conftest.py"}
        t.test_files |= t.collected
        return t

    def in_base(self, path: str) -> bool:
        return path in self.files or path in self.dirs

    def in_tree(self, path: str) -> bool:
        return os.path.lexists(self.tree / path)

    def exists(self, path: str) -> bool:
        return self.in_tree(path) or self.in_base(path)

    def text(self, path: str, base: bool = False) -> str | None:
        """The text of `path` in the base commit or the applied tree; None when absent or not a plain file."""
        if base:
            if path not in self.files:
                return None
            res = git(self.base, "cat-file", "blob", f"{self.commit}:{path}", check=False)
            return res.stdout if res.returncode == 0 else None
        # The applied tree is the agent's: any component of `path` may be a link, to the host's
        # files included.  Only a path that resolves to itself inside the tree is read (no link
        # anywhere on it, no `..`), so the grader never reads a host file through the workspace.
        root = self.tree.resolve()
        try:
            real = (root / path).resolve(strict=True)
        except (OSError, RuntimeError):  # absent, or a link loop
            return None
        if real != root / path or not real.is_file():
            return None
        try:
            return real.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None

    def basedir(self, path: str) -> str:
        """pytest's `prepend` base folder of `path`: the first folder up without an `__init__.py` in the base."""
        d = PurePosixPath(path).parent
        while str(d) != "." and self.in_base(str(d / "__init__.py")):
            d = d.parent
        return "" if str(d) == "." else str(d)

    def test_dirs(self) -> set[str]:
        """Every folder from the root down to a test file's or conftest's folder ("" = the root)."""
        out = {""}
        for f in self.test_files:
            for parent in PurePosixPath(f).parents:
                if str(parent) != ".":
                    out.add(str(parent))
        return out

    def dirs_with_tests(self) -> set[str]:
        return {("" if str(PurePosixPath(f).parent) == "." else str(PurePosixPath(f).parent)) for f in self.test_files
                if PurePosixPath(f).name == "conftest.py" or _is_test_module(PurePosixPath(f).name)}

    def config_value(self, key: str) -> str | list[str] | None:
        """The value of `key` in the base's root pytest configuration (the first file of pytest's order
        that holds a pytest table: https://docs.pytest.org/en/stable/reference/customize.html), or None.
        The base is trusted, so the standard library's parsers are enough here."""
        import configparser
        import tomllib

        for name in ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg"):
            text = self.text(name, base=True)
            if text is None:
                continue
            try:
                if name == "pyproject.toml":
                    table = tomllib.loads(text).get("tool", {}).get("pytest", {})
                    if not table:
                        continue  # pytest passes over a pyproject.toml without its table
                    return table.get("ini_options", {}).get(key, table.get(key))
                cp = configparser.ConfigParser(interpolation=None, strict=False)
                cp.read_string(text)
                section = {"setup.cfg": "tool:pytest"}.get(name, "pytest")
                if not cp.has_section(section):
                    continue
                return cp.get(section, key, fallback=None)
            except (configparser.Error, tomllib.TOMLDecodeError, AttributeError):
                continue
        return None

    def config_patterns(self, key: str) -> list[str]:
        """`config_value(key)` as a list of words (ini values are split on whitespace, as pytest's `args` type)."""
        value = self.config_value(key)
        return value.split() if isinstance(value, str) else [str(v) for v in value or []]

    def config_pythonpath(self) -> list[str]:
        """The `pythonpath` entries of the base's root pytest configuration (pytest puts them first on
        sys.path: https://docs.pytest.org/en/stable/reference/reference.html#confval-pythonpath)."""
        return [e.strip("/") if e not in (".", "./") else "" for e in self.config_patterns("pythonpath")]

    def env_roots(self, env: EnvNames, repo_inside: str) -> list[str]:
        """The test environment's `sys.path` entries inside the repository (editable installs), relative."""
        out = []
        inside = PurePosixPath(repo_inside)
        for entry in env.path:
            p = PurePosixPath(entry)
            if p == inside or inside in p.parents:
                rel = str(p.relative_to(inside))
                out.append("" if rel == "." else rel)
        return out

    def import_roots(self, env: EnvNames, repo_inside: str) -> list[str]:
        """Folders of the repository on the test run's `sys.path`: the root, each test file's and
        conftest's base folder, and the environment's own entries inside the repository (editable installs)."""
        roots = ["", *self.config_pythonpath(), *sorted({self.basedir(f) for f in self.test_files}),
                 *self.env_roots(env, repo_inside)]
        return list(dict.fromkeys(roots))

    def library_roots(self, env: EnvNames, repo_inside: str) -> list[str]:
        """Folders the package under test is imported from: the root, the configuration's `pythonpath`,
        the environment's entries inside the repository, and `src/` (setuptools' src layout)."""
        roots = ["", *self.config_pythonpath(), *self.env_roots(env, repo_inside), *(["src"] if "src" in self.dirs else [])]
        return list(dict.fromkeys(roots))


# --- the rules ----------------------------------------------------------------------------------


def _top_entry(path: str, root: str) -> str | None:
    """The top-level importable name `path` creates under `root` (a module or package), or None."""
    p, r = PurePosixPath(path), PurePosixPath(root) if root else None
    if r is not None and r not in p.parents:
        return None
    rel = p.relative_to(r) if r is not None else p
    first = rel.parts[0]
    if len(rel.parts) > 1:
        # Only a regular package replaces a module; a folder without `__init__` is a namespace
        # portion, which loses to any module or package of that name later on sys.path.
        return first if first.isidentifier() and len(rel.parts) == 2 and rel.parts[1].startswith("__init__.") else None
    stem = first.split(".", 1)[0]
    if first.endswith((".py", ".pyc", ".so", ".pyd", ".pyw")) and stem.isidentifier():
        return stem
    return None


def init_reason(trees: Trees, path: str) -> str | None:
    """Why a change to an `__init__.py` is on the test path (see the module docstring), or None."""
    p = PurePosixPath(path)
    if p.name != "__init__.py":
        return None
    folder = "" if str(p.parent) == "." else str(p.parent)
    if folder not in trees.test_dirs():
        return None
    where = folder or "the repository root"
    if not trees.in_base(path):
        return f"new __init__.py on the test path ({where}): pytest imports it while collecting"
    if not trees.in_tree(path):
        return f"removes an __init__.py on the test path ({where}): changes how pytest imports the tests"
    if folder in trees.dirs_with_tests():
        return f"__init__.py of a test package ({where})"
    return None


def shadow_reason(trees: Trees, path: str, env: EnvNames, roots: list[str]) -> str | None:
    """Why a new file makes a top-level module that replaces one importable in the test env, or None."""
    if trees.in_base(path):
        return None
    for root in roots:
        name = _top_entry(path, root)
        if name is None or name in _NOT_SHADOWS or name not in env.names:
            continue
        prefix = f"{root}/" if root else ""
        if any(trees.in_base(f"{prefix}{name}{suffix}") for suffix in ("", ".py")):
            continue  # the module already lives there: this adds to it, it replaces nothing
        return (f"shadows `{name}`, importable in the test environment, from {root or 'the repository root'} "
                f"(on sys.path when pytest runs)")
    return None



def own_top_names(trees: Trees, roots: list[str]) -> set[str]:
    """Top-level modules and packages the base repository itself provides (at `roots` and `src/`)."""
    out = set()
    for root in [*roots, "src"]:
        prefix = PurePosixPath(root) if root else None
        for f in trees.files:
            p = PurePosixPath(f)
            if prefix is not None and prefix not in p.parents:
                continue
            rel = p.relative_to(prefix) if prefix is not None else p
            if len(rel.parts) == 1 and rel.suffix == ".py" and rel.stem.isidentifier():
                out.add(rel.stem)
            elif len(rel.parts) == 2 and rel.name == "__init__.py" and rel.parts[0].isidentifier():
                out.add(rel.parts[0])
    return out


def _module_word(path: str) -> str:
    p = PurePosixPath(path)
    return p.parent.name if p.name == "__init__.py" else p.name.split(".", 1)[0]


def imported_new_files(trees: Trees, kept: list[str]) -> set[str]:
    """The new files among `kept` whose module name (the file's stem, or its package's name for an
    `__init__.py`) an import statement names: in another kept file, or in a file of the base
    (`git grep`, for a base module that tries an optional import)."""
    new = [p for p in kept if not trees.in_base(p)]
    texts = {p: trees.text(p) or "" for p in kept}
    out = set()
    for path in new:
        word = _module_word(path)
        if not word.isidentifier():
            continue
        pattern = re.compile(rf"^\s*(from|import)\s[^#\n]*\b{re.escape(word)}\b", re.M)
        if any(pattern.search(t) for p, t in texts.items() if p != path):
            out.add(path)
            continue
        res = git(trees.base, "grep", "-h", "-w", "-e", word, trees.commit, "--", "*.py", check=False)
        if any(pattern.search(line.partition(":")[2] if line.startswith(trees.commit) else line)
               for line in res.stdout.splitlines()):
            out.add(path)
    return out
