"""What of an applied patch the test run would load, judged by pytest's and Python's own import rules.

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
* **test helpers**: modules the instance's test files (and the conftests on their path)
  import, found with `ast`: a module with a test-like path (`tests/helpers.py`,
  `pkg/testing.py`, followed through its own imports) is reverted with the test files, and
  so is a module where the patch changes a checking function the tests import by name
  (`raises`, `assert_*`, `check_*`) that no library module uses (`from toolz.utils import
  raises`: the library uses `no_default` from there, never `raises`).
* **framework reach** (`framework_reach`): pytest runs the tests in the process the code under
  test runs in, so whatever that code does to pytest's objects is what the report shows.  A
  Python file the patch keeps is read with `ast`, and what it newly does (compared with the
  base version) that reaches into the test framework or the interpreter is listed: importing
  `_pytest`, `pytest` or `pluggy`; `unittest` beyond `unittest.mock`; defining pytest hooks
  (`pytest_*`) or `pytest_plugins`; writing `sys.modules`, `sys.meta_path`, `sys.path_hooks` or
  builtins; reading interpreter frames or the garbage collector's object lists; tracing
  hooks; `os._exit` and `atexit`; code or module names built at run time (`exec`, `eval`,
  `__import__` of a non-constant).  Any such finding grades the patch unresolved, with the
  finding recorded (`report["tampering"]`).  A framework the repository itself provides
  (pytest's own repository) is not counted.
"""
from __future__ import annotations

import ast
import dataclasses
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
_TESTISH_PARTS = frozenset({"test", "tests", "testing"})
_TESTISH_STEMS = frozenset({"testing", "tests", "test", "conftest", "fixtures", "testutils", "test_utils", "testlib"})


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
try:
    import importlib.metadata as md
    names.update(md.packages_distributions())
except Exception:
    pass
print("''' + PROBE_MARKER + r'''" + json.dumps({"names": sorted(names), "path": sys.path,
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
                    return cls(names, tuple(str(p) for p in data.get("path", [])), True)
                except (ValueError, KeyError, TypeError):
                    break
        return cls.fallback()


# --- the trees ----------------------------------------------------------------------------------


def _is_test_module(name: str) -> bool:
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


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

    @classmethod
    def scan(cls, base: Path, commit: str, tree: Path, protected: Iterable[str]) -> "Trees":
        """Raises `RuntimeSetupError` when the base commit cannot be listed."""
        t = cls(base, commit, tree, set(protected))
        listing = git(base, "ls-tree", "-r", "-z", "--name-only", commit, stage="grade").stdout
        t.files = {f for f in listing.split("\0") if f}
        t.dirs = {""} | {str(d) for f in t.files for d in PurePosixPath(f).parents if str(d) != "."}
        for path in sorted(t.files):
            name = PurePosixPath(path).name
            if name.endswith(".py") and not (_SKIP_DIRS & set(PurePosixPath(path).parts[:-1])):
                t.py_files.append(path)
                if name == "conftest.py" or _is_test_module(name):
                    t.test_files.add(path)
        t.test_files |= {p for p in t.protected if p.endswith(".py")}
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
        full = self.tree / path
        if full.is_symlink() or not full.is_file():
            return None
        try:
            return full.read_text(encoding="utf-8", errors="replace")
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

    def config_pythonpath(self) -> list[str]:
        """The `pythonpath` entries of the base's root pytest configuration (pytest puts them first on
        sys.path: https://docs.pytest.org/en/stable/reference/reference.html#confval-pythonpath).
        The base is trusted, so the standard library's parsers are enough here."""
        import configparser
        import tomllib

        for name in ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg"):
            text = self.text(name, base=True)
            if text is None:
                continue
            value = None
            try:
                if name == "pyproject.toml":
                    table = tomllib.loads(text).get("tool", {}).get("pytest", {})
                    if not table:
                        continue  # pytest passes over a pyproject.toml without its table
                    value = table.get("ini_options", {}).get("pythonpath", table.get("pythonpath"))
                else:
                    cp = configparser.ConfigParser(interpolation=None, strict=False)
                    cp.read_string(text)
                    section = {"setup.cfg": "tool:pytest"}.get(name, "pytest")
                    value = cp.get(section, "pythonpath", fallback=None) if cp.has_section(section) else None
                    if value is None and not cp.has_section(section):
                        continue
            except (configparser.Error, tomllib.TOMLDecodeError, AttributeError):
                continue
            entries = value.split() if isinstance(value, str) else [str(v) for v in value or []]
            return [e.strip("/") if e not in (".", "./") else "" for e in entries]
        return []

    def import_roots(self, env: EnvNames, repo_inside: str) -> list[str]:
        """Folders of the repository on the test run's `sys.path`: the root, each test file's and
        conftest's base folder, and the environment's own entries inside the repository (editable installs)."""
        roots = ["", *self.config_pythonpath(), *sorted({self.basedir(f) for f in self.test_files})]
        inside = PurePosixPath(repo_inside)
        for entry in env.path:
            p = PurePosixPath(entry)
            if p == inside or inside in p.parents:
                rel = str(p.relative_to(inside))
                roots.append("" if rel == "." else rel)
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


def is_testish(path: str) -> bool:
    """A path that names test code: a `test`/`tests`/`testing` folder or a test-like module name."""
    p = PurePosixPath(path)
    stem = p.name[:-3] if p.name.endswith(".py") else p.name
    if stem == "__init__":
        stem = p.parent.name
    return bool(_TESTISH_PARTS & set(p.parts[:-1])) or stem in _TESTISH_STEMS or stem.startswith("test_") \
        or stem.endswith(("_test", "_tests", "_testing"))


def _parse(text: str | None) -> ast.Module | None:
    if text is None:
        return None
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):
        return None


def _test_source(trees: Trees, test_patch_added: dict[str, str], path: str) -> list[ast.Module]:
    """The parsed versions of a test file: the base's, and the lines `test_patch` adds to it."""
    out = []
    for text in (trees.text(path, base=True), test_patch_added.get(path)):
        tree = _parse(text)
        if tree is None and text:  # lines added to a file: read the import lines one by one
            lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith(("import ", "from "))]
            tree = _parse("\n".join(ln for ln in lines if _parse(ln) is not None))
        if tree is not None:
            out.append(tree)
    return out


def _resolve(trees: Trees, dotted: str, roots: list[str]) -> str | None:
    parts = dotted.split(".")
    for root in roots:
        base = PurePosixPath(root) if root else PurePosixPath()
        for cand in (base.joinpath(*parts).with_suffix(".py") if parts else None,
                     base.joinpath(*parts, "__init__.py")):
            if cand is not None and trees.exists(str(cand)):
                return str(cand)
    return None


def _imports(trees: Trees, module: ast.Module, path: str, roots: list[str]) -> list[tuple[str, list[str]]]:
    """(workspace file, names imported from it by name) for each import of `module` that resolves
    to a file of the repository."""
    out: list[tuple[str, list[str]]] = []
    own = [trees.basedir(path), *roots]
    pkg = PurePosixPath(path).parent.parts
    for node in ast.walk(module):
        if isinstance(node, ast.Import):
            for alias in node.names:
                hit = _resolve(trees, alias.name, own)
                if hit:
                    out.append((hit, []))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = pkg[: len(pkg) - (node.level - 1)] if node.level - 1 <= len(pkg) else ()
                dotted_parts = [*anchor, *(node.module.split(".") if node.module else [])]
                search = [""]
            else:
                dotted_parts = node.module.split(".") if node.module else []
                search = own
            dotted = ".".join(dotted_parts)
            hit = _resolve(trees, dotted, search) if dotted else None
            if hit:
                out.append((hit, [a.name for a in node.names]))
            for alias in node.names:  # `from pkg import submodule`
                sub = _resolve(trees, f"{dotted}.{alias.name}" if dotted else alias.name, search)
                if sub:
                    out.append((sub, []))
    return out


def _definition(module: ast.Module | None, name: str) -> str | None:
    if module is None:
        return None
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return ast.dump(node)
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return ast.dump(node)
    return None


def _library_uses(trees: Trees, name: str, skip: str) -> bool:
    """Whether a non-test module of the base (other than `skip`) refers to `name` (`git grep`
    finds the candidates, `ast` confirms)."""
    res = git(trees.base, "grep", "-l", "-w", "-e", name, trees.commit, "--", "*.py", check=False)
    for line in res.stdout.splitlines():
        path = line.split(":", 1)[1] if line.startswith(trees.commit + ":") else line
        if path == skip or path in trees.test_files or is_testish(path):
            continue
        module = _parse(trees.text(path, base=True))
        if module is None:
            return True
        for node in ast.walk(module):
            if (isinstance(node, ast.Name) and node.id == name) or (isinstance(node, ast.Attribute) and node.attr == name) \
                    or (isinstance(node, ast.alias) and name in (node.name, node.asname)):
                return True
    return False


# Names of functions whose job is to check (`raises`, `assert_equal`, `check_output_matches`): the
# tests' tools, not the code they test.  A public function the tests call (`slugify`) is not one.
_CHECKER = re.compile(r"^_*(assert|raises|check|expect|verify|fails?_|must|should|eq_|ok_|approx|compare)|assert|raises",
                      re.I)


def helper_reasons(trees: Trees, changed: set[str], roots: list[str], test_patch_added: dict[str, str]) -> dict[str, str]:
    """{changed module: reason} for the test helpers the instance's tests import (module docstring)."""
    sources = sorted(p for p in trees.protected if p.endswith(".py"))
    conftests = {f for f in trees.test_files if PurePosixPath(f).name == "conftest.py"}
    dirs = {str(d) for s in sources for d in PurePosixPath(s).parents}
    sources += sorted(c for c in conftests if str(PurePosixPath(c).parent) in dirs)
    reasons: dict[str, str] = {}
    seen, queue = set(sources), [(s, s) for s in sources]
    by_name: dict[str, dict[str, str]] = {}  # module -> {name: importing test file}
    while queue:
        path, origin = queue.pop()
        modules = _test_source(trees, test_patch_added, path) if path in trees.protected else \
            [m for m in (_parse(trees.text(path, base=True)), _parse(trees.text(path))) if m is not None]
        for module in modules:
            for hit, names in _imports(trees, module, path, roots):
                if hit in trees.test_files or hit == path:
                    continue
                if is_testish(hit):
                    if hit in changed:
                        reasons.setdefault(hit, f"test helper imported by {origin}")
                    if hit not in seen:
                        seen.add(hit)
                        queue.append((hit, origin))
                elif path in trees.test_files:
                    for n in names:
                        by_name.setdefault(hit, {}).setdefault(n, path)
    for module_path, names in by_name.items():
        if module_path not in changed or module_path in reasons:
            continue
        before, after = _parse(trees.text(module_path, base=True)), _parse(trees.text(module_path))
        for name, origin in sorted(names.items()):
            if name == "*" or _definition(before, name) == _definition(after, name):
                continue
            if _definition(before, name) is None and _definition(after, name) is None:
                continue
            if _CHECKER.search(name) and not _library_uses(trees, name, module_path):
                reasons[module_path] = f"changes test helper `{name}`, which {origin} imports and no library module uses"
                break
    return reasons


def test_patch_additions(test_patch: str) -> dict[str, str]:
    """{path: the text of the lines `test_patch` adds to it} (for the imports of new tests)."""
    from app.grading.patching import PatchReadError, read_patch

    out: dict[str, str] = {}
    if not test_patch or not test_patch.strip():
        return out
    try:
        files = read_patch(test_patch).files
    except PatchReadError:
        return out
    for f in files:
        if f.new is None:
            continue
        added = [ln[1:] for ln in f.text.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
        out[f.new] = "\n".join(added) + "\n"
    return out


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


# --- framework reach ----------------------------------------------------------------------------

FRAMEWORKS = ("_pytest", "pytest", "pluggy")
_BUILTINS = frozenset({"builtins", "__builtins__", "__builtin__"})
_SYS_IMPORT_STATE = frozenset({"sys.modules", "sys.meta_path", "sys.path_hooks", "sys.path_importer_cache"})
_MUTATORS = frozenset({"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__", "insert",
                       "append", "extend", "remove"})
_INTERNALS = {
    "sys._getframe": "reads interpreter frames", "sys._current_frames": "reads interpreter frames",
    "inspect.currentframe": "reads interpreter frames", "inspect.stack": "reads interpreter frames",
    "inspect.getouterframes": "reads interpreter frames", "inspect.trace": "reads interpreter frames",
    "sys.settrace": "installs a tracing hook", "sys.setprofile": "installs a tracing hook",
    "threading.settrace": "installs a tracing hook", "threading.setprofile": "installs a tracing hook",
    "sys.monitoring": "installs a tracing hook", "sys.addaudithook": "installs an audit hook",
    "gc.get_objects": "walks the garbage collector's objects", "gc.get_referrers": "walks the garbage collector's objects",
    "gc.get_referents": "walks the garbage collector's objects",
    "os._exit": "exits the interpreter past the test runner", "atexit.register": "runs code after the test runner",
    "sys.__stdout__": "writes past the test runner's output capture",
    "sys.__stderr__": "writes past the test runner's output capture",
}
_FRAME_ATTRS = frozenset({"f_back", "f_globals", "f_locals", "f_builtins", "tb_frame", "gi_frame", "cr_frame", "ag_frame"})
_HOOK_STRING = re.compile(r"^(_pytest(\.\w+)*|pytest\.\w+(\.\w+)*|pluggy(\.\w+)*|pytest_\w+|unittest\.(?!mock\b)\w+(\.\w+)*)$")


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


class _Reach(ast.NodeVisitor):
    def __init__(self, own: set[str], depth: int = 0):
        self.own, self.depth = own, depth
        self.aliases: dict[str, str] = {}
        self.found: set[str] = set()

    def module(self, name: str, names: Iterable[str] = ()) -> None:
        top, _, rest = name.partition(".")
        if top in self.own:
            return
        if top in FRAMEWORKS:
            self.found.add(f"imports the test framework ({name})")
        elif top == "unittest":
            sub = rest.split(".")[0] if rest else None
            if sub and sub != "mock" or (not sub and any(n != "mock" for n in names)) or (not sub and not names):
                self.found.add(f"imports unittest internals ({name}{' ' + ', '.join(names) if names else ''})")
        elif top == "ctypes":
            self.found.add("imports ctypes (raw memory access)")
        elif top == "sys":
            for n in names:
                key = f"sys.{n}"
                if key in _SYS_IMPORT_STATE:
                    self.found.add(f"imports {key}")
                elif key in _INTERNALS:
                    self.found.add(f"{_INTERNALS[key]} ({key})")
        elif top in ("inspect", "gc", "os", "atexit", "threading"):
            for n in names:
                key = f"{top}.{n}"
                if key in _INTERNALS:
                    self.found.add(f"{_INTERNALS[key]} ({key})")

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.module(a.name)
            if a.asname:
                self.aliases[a.asname] = a.name
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if not node.level and node.module:
            self.module(node.module, [a.name for a in node.names])
            for a in node.names:
                self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        self.generic_visit(node)

    def _def(self, node) -> None:
        if node.name.startswith("pytest_") and not self.own & set(FRAMEWORKS):  # pytest's own repository
            self.found.add(f"defines a pytest hook ({node.name})")
        self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = _def

    def visit_Name(self, node: ast.Name) -> None:
        if node.id == "pytest_plugins" and isinstance(node.ctx, ast.Store):
            self.found.add("sets pytest_plugins")
        dotted = self.aliases.get(node.id)
        if dotted:
            self._dotted_use(dotted, node.ctx)

    def _dotted_use(self, dotted: str, ctx: ast.expr_context) -> None:
        top = dotted.split(".")[0]
        if top in self.own:
            return
        if top in _BUILTINS and isinstance(ctx, (ast.Store, ast.Del)) and "." in dotted:
            self.found.add(f"assigns builtins ({dotted})")
        if top == "unittest" and len(dotted.split(".")) > 1 and dotted.split(".")[1] != "mock":
            self.found.add(f"reaches into unittest ({'.'.join(dotted.split('.')[:3])})")
        if top in FRAMEWORKS:
            self.found.add(f"reaches into the test framework ({'.'.join(dotted.split('.')[:3])})")
        for key, what in _INTERNALS.items():
            if dotted == key or dotted.startswith(key + "."):
                self.found.add(f"{what} ({key})")
        if isinstance(ctx, (ast.Store, ast.Del)) and any(dotted == k or dotted.startswith(k + ".") for k in _SYS_IMPORT_STATE):
            self.found.add(f"writes {'.'.join(dotted.split('.')[:2])}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in _FRAME_ATTRS:
            self.found.add(f"reads interpreter frames (.{node.attr})")
        dotted = _dotted(node, self.aliases)
        if dotted:
            self._dotted_use(dotted, node.ctx)
            if isinstance(node.ctx, ast.Load):
                return  # its prefix is a part of this chain, judged once
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        target = _dotted(node.value, self.aliases)
        if isinstance(node.ctx, (ast.Store, ast.Del)) and target:
            if target in _SYS_IMPORT_STATE:
                self.found.add(f"writes {target}")
            if target.split(".")[0] in _BUILTINS:
                self.found.add(f"assigns builtins ({target}[...])")
        if isinstance(node.ctx, ast.Load) and target == "sys.modules" and not (
                isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
            self.found.add("reads sys.modules with a key built at run time")
        if isinstance(node.ctx, (ast.Store, ast.Del)) and isinstance(node.value, ast.Call):
            inner = _dotted(node.value.func, self.aliases)
            if inner == "vars" and node.value.args and (_dotted(node.value.args[0], self.aliases) or "").split(".")[0] in _BUILTINS:
                self.found.add("assigns builtins (vars(builtins)[...])")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = _dotted(node.func, self.aliases) or ""
        first = node.args[0] if node.args else None
        const = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
        if func in ("setattr", "delattr") and first is not None:
            target = _dotted(first, self.aliases) or ""
            if target.split(".")[0] in _BUILTINS:
                self.found.add(f"assigns builtins ({func}({target}, ...))")
            if target in _SYS_IMPORT_STATE or target == "sys":
                self.found.add(f"writes {target} ({func})")
            if target.split(".")[0] in FRAMEWORKS + ("unittest",) and target.split(".")[0] not in self.own:
                self.found.add(f"patches the test framework ({func}({target}, ...))")
        head, _, method = func.rpartition(".")
        if method in _MUTATORS and (head in _SYS_IMPORT_STATE or head.split(".")[0] in _BUILTINS):
            self.found.add(f"writes {head} (.{method})")
        if func in ("sys.modules.values", "sys.modules.items", "sys.modules.copy", "sys.modules.keys"):
            self.found.add(f"walks sys.modules ({func})")
        if func == "sys.modules.get" and const is None:
            self.found.add("reads sys.modules with a key built at run time")
        if func == "sys.modules.get" and const is not None:
            self.module(const)
        if func in ("__import__", "importlib.import_module", "importlib.__import__", "builtins.__import__"):
            if const is not None:
                self.module(const)
            else:
                self.found.add(f"imports a module named at run time ({func})")
        if func in ("exec", "eval", "compile", "builtins.exec", "builtins.eval"):
            if const is not None and self.depth < 3:
                inner = _parse(const)
                if inner is not None:
                    sub = _Reach(self.own, self.depth + 1)
                    sub.aliases = dict(self.aliases)
                    sub.visit(inner)
                    self.found |= sub.found
            elif const is None:
                self.found.add(f"runs code built at run time ({func})")
        if func == "vars" and first is not None and (_dotted(first, self.aliases) or "").split(".")[0] in _BUILTINS:
            self.found.add("reaches builtins' namespace (vars(builtins))")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and node.value in _FRAME_ATTRS:
            self.found.add(f"reads interpreter frames ({node.value!r})")
        if isinstance(node.value, str) and len(node.value) < 200 and _HOOK_STRING.match(node.value):
            top = node.value.split(".")[0]
            if top not in self.own:
                self.found.add(f"names the test framework in a string ({node.value!r})")


def reach_findings(text: str | None, own: set[str]) -> set[str] | None:
    """What `text` (Python source) does that reaches into the test framework or the interpreter
    (module docstring); None when it does not parse."""
    module = _parse(text)
    if module is None:
        return None
    visitor = _Reach(own)
    visitor.visit(module)
    return visitor.found


def framework_reach(base_text: str | None, new_text: str | None, own: set[str] = frozenset()) -> list[str]:
    """The findings of `new_text` that `base_text` (None: a new file) does not have, sorted.

    `own`: top-level names the repository provides itself (its own `_pytest`, say), never counted.
    A new text that does not parse has no findings (Python cannot import it either).
    """
    after = reach_findings(new_text, set(own))
    if not after:
        return []
    before = reach_findings(base_text, set(own)) or set()
    return sorted(after - before)
