"""Which changed modules are test code: what the test runner treats as test code, not what a path looks like.

The instance's tests run under the base commit's test code, so a change to test code is put back
after the patch is applied; library code is the code under test, and a fix there is kept wherever
its file lives (`django/test/utils.py`, `src/_pytest/fixtures.py`, `xarray/testing.py` are library
code).  The rule, read from the base tree (`surface.Trees`) and the probed test environment:

Test code (put back when the patch changes it):

1. **collected test files**: the files pytest collects by the base configuration's
   `python_files` (default `test_*.py`, `*_test.py`;
   https://docs.pytest.org/en/stable/reference/reference.html#confval-python_files), and the
   instance's own test files (`test_files`, the files of its test ids);
2. **`conftest.py`** files (`patching.harness_change_reason`, by name);
3. the files **`test_patch`** adds or changes (the instance's own test files);
4. **test-support modules**: a module the instance's tests import (directly, or through
   another test-support module) that is not library code.  The *test directories* are the
   folders holding collected test files, with their subfolders (a subfolder walk stops at a
   library root: the repository root, `src/`, the configuration's `pythonpath`, the test
   environment's `sys.path` entries inside the repository), and a top-level package named like
   tests (`tests/`, `test/`, `testing/`) that holds collected tests.

Library code (never put back by rule 4, whatever its path looks like):

* a module of a package the test run imports from a library root (a top-level regular package
  or module there), outside the test directories: `django/test/utils.py` when Django's tests
  live in `tests/`, `src/_pytest/fixtures.py` beside `testing/`, `pint/testing.py` beside
  `pint/testsuite/`, `src/cachetools/test/utils.py` beside `tests/`;
* a module directly at a library root that also holds collected tests (a one-module
  distribution with its tests beside it) when an installed distribution provides its name
  (`importlib.metadata.packages_distributions`, probed in the test environment), or when a
  collected test file beside it is named for it (`calc.py` beside `test_calc.py`, installed or not);
* a module inside a test directory that library code imports (its package's own code uses
  it, so it ships as part of the package: `numpy/testing/_private/utils.py`-style).

A module in a test directory that no library code imports (`tornado/test/util.py`,
`pint/testsuite/helpers.py`, `tests/helpers.py`), or outside every package the test run
imports, is test support: it exists for the tests.

5. **test helpers hiding in library code**: a library module where the patch changes a checking
   function (`raises`, `assert_*`, `check_*`) the tests import by name, that no library module
   uses and the module does not export (`__all__`) is put back too (`from toolz.utils import
   raises`: toolz uses `no_default` from there, never `raises`).  A module whose name says it is
   a testing API (`pint/testing.py`, `xarray/testing/`) is exempt: its checkers are the API it
   ships.

**Undecided layouts.**  A base where pytest's `python_files` patterns match no test file (the
instance's tests are `tests.py` modules run by another runner, say) gives the rules nothing to stand on;
then a module the tests import is test code when its path looks like test code (`is_testish`:
a `test`/`tests`/`testing` folder or a test-like module name), the conservative rule, and the
report says so (`Layout.summary()["decided"] is False`).
"""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import PurePosixPath

from app.gitutil import git
from app.grading.imports import definition, imports_of, parse, parsed_test_file, test_patch_additions
from app.grading.surface import CONFIG_FILES, EnvNames, Trees, collects, init_reason, shadow_reason

_TESTISH_PARTS = frozenset({"test", "tests", "testing"})
_TESTISH_STEMS = frozenset({"testing", "tests", "test", "conftest", "fixtures", "testutils", "test_utils", "testlib"})
# Names of functions whose job is to check (`raises`, `assert_equal`, `check_output_matches`): the
# tests' tools, not the code they test.  A public function the tests call (`slugify`) is not one.
_CHECKER = re.compile(r"^_*(assert|raises|check|expect|verify|fails?_|must|should|eq_|ok_|approx|compare)|assert|raises",
                      re.I)
UNDECIDED = "pytest collects no test file of the base: the conservative rule (a test-like path is test code)"


def is_testish(path: str) -> bool:
    """A path that looks like test code: a `test`/`tests`/`testing` folder or a test-like module name."""
    p = PurePosixPath(path)
    stem = p.name[:-3] if p.name.endswith(".py") else p.name
    if stem == "__init__":
        stem = p.parent.name
    return bool(_TESTISH_PARTS & set(p.parts[:-1])) or stem in _TESTISH_STEMS or stem.startswith("test_") \
        or stem.endswith(("_test", "_tests", "_testing"))


def _folder(path: str) -> str:
    parent = str(PurePosixPath(path).parent)
    return "" if parent == "." else parent


def _where(folder: str) -> str:
    return folder or "the repository root"


@dataclasses.dataclass
class Layout:
    """The test layout of the base: `test_dirs` (folders holding collected test files),
    `library_roots` (folders the test run imports the package from) and whether the rules can
    decide (`decided`: the base has collected test files)."""

    trees: Trees
    roots: list[str]
    env: EnvNames
    test_dirs: set[str]
    library_roots: list[str]
    decided: bool
    repo_inside: str = "/testbed"
    _library: dict[str, str | None] = dataclasses.field(default_factory=dict)

    @classmethod
    def read(cls, trees: Trees, env: EnvNames, repo_inside: str) -> "Layout":
        """The layout of `trees` for a test run in `env` with the repository at `repo_inside`."""
        test_dirs = {_folder(f) for f in trees.collected}
        library_roots = trees.library_roots(env, repo_inside)
        roots = list(dict.fromkeys([*trees.import_roots(env, repo_inside), *library_roots]))
        # Decided when pytest's own patterns pick out test files: instance test files it would not
        # collect (`tests.py` under the default patterns) give no layout to stand on.
        decided = any(collects(trees.python_files, f) for f in trees.collected)
        return cls(trees, roots, env, test_dirs, library_roots, decided, repo_inside)

    def summary(self) -> dict:
        """What the report shows of the layout: decided, the rule used, the test directories."""
        return {"decided": self.decided,
                "rule": "test code is what pytest collects and what only the tests use" if self.decided else UNDECIDED,
                "collected_test_files": len(self.trees.collected),
                "test_dirs": sorted(_where(d) for d in self.test_dirs)[:20],
                "library_roots": [_where(r) for r in self.library_roots]}

    def package_of(self, path: str) -> tuple[str, str] | None:
        """(library root, top-level name) of the package or module `path` belongs to, or None."""
        p = PurePosixPath(path)
        for root in self.library_roots:
            base = PurePosixPath(root) if root else None
            if base is not None and base not in p.parents:
                continue
            rel = p.relative_to(base) if base is not None else p
            if len(rel.parts) == 1:
                if rel.suffix == ".py" and rel.stem.isidentifier():
                    return root, rel.stem
                continue
            top = rel.parts[0]
            init = f"{root}/{top}/__init__.py" if root else f"{top}/__init__.py"
            if top.isidentifier() and self.trees.in_base(init):
                return root, top
        return None

    def test_dir_of(self, path: str) -> str | None:
        """The test directory `path` lies in (module docstring), or None."""
        folder = _folder(path)
        if folder in self.test_dirs:
            return folder
        for parent in PurePosixPath(folder).parents if folder else ():
            d = "" if str(parent) == "." else str(parent)
            if d in self.library_roots:
                break
            if d in self.test_dirs:
                return d
        pkg = self.package_of(path)
        if pkg is not None and pkg[1] in _TESTISH_PARTS:
            top = f"{pkg[0]}/{pkg[1]}" if pkg[0] else pkg[1]
            if any(f.startswith(top + "/") for f in self.trees.collected):
                return top
        return None

    def library_reason(self, path: str) -> str | None:
        """Why `path` is library code (module docstring), or None when it is not."""
        if path not in self._library:
            self._library[path] = None  # guards the import walk against cycles
            self._library[path] = self._library_reason(path)
        return self._library[path]

    def _library_reason(self, path: str) -> str | None:
        if not self.decided:
            return None if is_testish(path) else "not test-like by name (undecided layout: the conservative rule)"
        test_dir = self.test_dir_of(path)
        pkg = self.package_of(path)
        if test_dir is None and pkg is not None:
            return (f"library code: part of `{pkg[1]}`, imported from {_where(pkg[0])}, "
                    f"outside the test directories")
        if pkg is not None and test_dir == pkg[0] and _folder(path) == pkg[0]:
            if pkg[1] in self.env.dist_names:
                return f"library code: top-level module `{pkg[1]}` of an installed distribution"
            named = {f"test_{pkg[1]}.py", f"{pkg[1]}_test.py"}
            if any(PurePosixPath(f).name in named and _folder(f) == pkg[0] for f in self.trees.collected):
                # A one-module project with its tests beside it (`calc.py` + `test_calc.py`) need not
                # be installed to be the code under test: a correct fix there must never be reverted.
                return f"library code: top-level module `{pkg[1]}`, the module its test file is named for"
            if not self.env.probed and not is_testish(path):
                return (f"library code: top-level module `{pkg[1]}` (test environment not probed: "
                        f"judged by its name)")
        via = self.imported_by_library(path)
        return f"library code: imported by library module {via}" if via else None

    def support_reason(self, path: str) -> str:
        """Why a module the tests import that is not library code is test support."""
        if not self.decided:
            return "test-like path (undecided layout: the conservative rule)"
        test_dir = self.test_dir_of(path)
        if test_dir is not None:
            return f"in the test directory {_where(test_dir)}, and no library code imports it"
        return "outside every package the test run imports, and no library code imports it"

    def is_test_code(self, path: str) -> bool:
        """Collected test files, conftests, the instance's own files, or a test directory's modules."""
        return path in self.trees.test_files or (self.decided and self.test_dir_of(path) is not None)

    def imported_by_library(self, path: str) -> str | None:
        """A library module of the base that imports `path` (`git grep` finds candidates, `ast`
        confirms the import resolves to `path`), or None."""
        p = PurePosixPath(path)
        word = p.parent.name if p.name == "__init__.py" else p.name.split(".", 1)[0]
        if not word.isidentifier():
            return None
        res = git(self.trees.base, "grep", "-l", "-w", "-e", word, self.trees.commit, "--", "*.py", check=False)
        for line in res.stdout.splitlines():
            cand = line.split(":", 1)[1] if line.startswith(self.trees.commit + ":") else line
            if cand == path or cand in self.trees.test_files:
                continue
            module = parse(self.trees.text(cand, base=True))
            if module is None or not any(hit == path for hit, _ in imports_of(self.trees, module, cand, self.roots)):
                continue
            if self.library_reason(cand):
                return cand
        return None


def _exported(module: ast.Module | None, name: str) -> bool:
    """Whether `module` lists `name` in a literal `__all__`."""
    for node in module.body if module is not None else ():
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                if any(isinstance(c, ast.Constant) and c.value == name for c in ast.walk(node.value)):
                    return True
    return False


def _library_uses(layout: Layout, name: str, skip: str) -> bool:
    """Whether a module of the base that is not test code (other than `skip`) refers to `name`
    (`git grep` finds the candidates, `ast` confirms)."""
    trees = layout.trees
    res = git(trees.base, "grep", "-l", "-w", "-e", name, trees.commit, "--", "*.py", check=False)
    for line in res.stdout.splitlines():
        path = line.split(":", 1)[1] if line.startswith(trees.commit + ":") else line
        if path == skip or path in trees.test_files or (layout.test_dir_of(path) if layout.decided else is_testish(path)):
            continue
        module = parse(trees.text(path, base=True))
        if module is None:
            return True
        for node in ast.walk(module):
            if (isinstance(node, ast.Name) and node.id == name) or (isinstance(node, ast.Attribute) and node.attr == name) \
                    or (isinstance(node, ast.alias) and name in (node.name, node.asname)):
                return True
    return False


@dataclasses.dataclass
class Verdict:
    """`reverted` {path: reason} (test code the patch changed: put back) and `kept` {path: why}
    (changed modules the tests import that are library code: kept, whatever their path)."""

    reverted: dict[str, str]
    kept: dict[str, str]


def judge(layout: Layout, changed: set[str], test_patch_added: dict[str, str]) -> Verdict:
    """Rules 4 and 5 of the module docstring over the modules the instance's tests import.

    `changed`: paths the applied patch changes, less those already put back; `test_patch_added`:
    `imports.test_patch_additions(test_patch)`."""
    trees = layout.trees
    sources = sorted(p for p in trees.protected if p.endswith(".py"))
    conftests = {f for f in trees.test_files if PurePosixPath(f).name == "conftest.py"}
    dirs = {str(d) for s in sources for d in PurePosixPath(s).parents}
    sources += sorted(c for c in conftests if str(PurePosixPath(c).parent) in dirs)
    verdict = Verdict({}, {})
    seen, queue = set(sources), [(s, s) for s in sources]
    by_name: dict[str, dict[str, str]] = {}  # library module -> {name: importing test file}
    while queue:
        path, origin = queue.pop()
        modules = parsed_test_file(trees, test_patch_added, path) if path in trees.protected else \
            [m for m in (parse(trees.text(path, base=True)), parse(trees.text(path))) if m is not None]
        for module in modules:
            for hit, names in imports_of(trees, module, path, layout.roots):
                if hit in trees.test_files or hit == path:
                    continue
                library = layout.library_reason(hit)
                if library is None:
                    if hit in changed:
                        verdict.reverted.setdefault(hit, f"test support: imported by {origin}, {layout.support_reason(hit)}")
                    if hit not in seen:
                        seen.add(hit)
                        queue.append((hit, origin))
                    continue
                if hit in changed:
                    verdict.kept.setdefault(hit, library)
                if path in trees.test_files:
                    for n in names:
                        by_name.setdefault(hit, {}).setdefault(n, path)
    for module_path, names in by_name.items():
        if module_path not in changed or module_path in verdict.reverted or is_testish(module_path):
            continue  # a testing API the package ships (module docstring, rule 5) keeps its checkers
        before, after = parse(trees.text(module_path, base=True)), parse(trees.text(module_path))
        for name, origin in sorted(names.items()):
            if name == "*" or definition(before, name) == definition(after, name):
                continue
            if _CHECKER.search(name) and not _exported(before, name) and not _library_uses(layout, name, module_path):
                verdict.reverted[module_path] = (f"test helper in library code: changes `{name}`, a checker {origin} "
                                                 f"imports that no library module uses or exports")
                verdict.kept.pop(module_path, None)
                break
    return verdict


def collected_reason(trees: Trees, path: str) -> str | None:
    """Why `path` is a test file pytest collects by the base's `python_files` (rule 1), or None.
    (The default patterns are judged by name in `patching.harness_change_reason`.)"""
    if path in trees.collected or (not trees.in_base(path) and PurePosixPath(path).suffix == ".py"
                                   and collects(trees.python_files, path)):
        return f"collected test file (pytest's python_files: {' '.join(trees.python_files)})"
    return None


def put_back(trees: Trees, layout: Layout, changed: set[str], env: EnvNames, protected: set[str],
             test_patch: str = "") -> tuple[dict[str, str], dict]:
    """({path: reason} of the changed files to put back, the report's `test_surface`).

    Each path is judged by the first rule that takes it: by name (`patching.harness_change_reason`),
    pytest configuration (put back whole: nothing parsed, no parser to disagree with), an
    `__init__.py` on the test path and shadowing (`app.grading.surface`), a collected test file,
    then the modules the tests import (`judge`).  The report holds the layout (`Layout.summary`),
    {path: {rule, why}} put back and {path: why} kept as library code."""
    from app.grading.patching import harness_change_reason

    roots = trees.import_roots(env, layout.repo_inside)  # sys.path as the test run has it
    reasons: dict[str, str] = {}
    rules: dict[str, str] = {}
    for path in sorted(changed):
        for rule, reason in (("by name", harness_change_reason(path, protected)),
                             ("pytest configuration", "pytest configuration" if PurePosixPath(path).name
                              in CONFIG_FILES else None),
                             ("__init__.py on the test path", init_reason(trees, path)),
                             ("shadowing", shadow_reason(trees, path, env, roots)),
                             ("collected test file", collected_reason(trees, path))):
            if reason:
                reasons[path], rules[path] = reason, rule
                break
    verdict = judge(layout, changed - set(reasons), test_patch_additions(test_patch))
    for path, reason in verdict.reverted.items():
        reasons[path], rules[path] = reason, reason.split(":", 1)[0]
    report = {"layout": layout.summary(), "kept": dict(sorted(verdict.kept.items())),
              "reverted": {p: {"rule": rules[p], "why": reasons[p]} for p in sorted(reasons)}}
    return dict(sorted(reasons.items())), report
