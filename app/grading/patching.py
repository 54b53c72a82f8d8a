"""Read an agent patch, drop its changes to the test harness, and the SWE-bench apply chain.

The rule (an honest reward): the instance's tests run under the base commit's test
configuration.  What the agent may change is the code under test; what it may not
change is what runs the tests and how.  A change to any of these is dropped:

  * the instance's own test files: `test_files`, every file `test_patch` touches, the
    files named by pytest-style FAIL_TO_PASS / PASS_TO_PASS ids (`path.py::name`);
  * test modules by name: `conftest.py`, `test_*.py`, `*_test.py` (pytest's defaults,
    https://docs.pytest.org/en/stable/reference/reference.html#confval-python_files);
  * pytest configuration files: `pytest.ini`, `.pytest.ini`, `tox.ini`, `pytest.toml`,
    `.pytest.toml` (https://docs.pytest.org/en/stable/reference/customize.html);
    `setup.cfg` and `pyproject.toml` are kept in the patch (a fix may need the rest of the
    tree to apply) and put back whole after it is applied (`app.grading.surface`): pytest
    reads them with its own parsers, so nothing short of the whole file is safe to keep;
  * interpreter start-up hooks: `sitecustomize.py`, `usercustomize.py`, `*.pth`
    (https://docs.python.org/3/library/site.html);
  * package metadata (`*.dist-info`, `*.egg-info`, `*.egg`), where a `pytest11` entry
    point would make pytest autoload a plugin from the workspace
    (https://docs.pytest.org/en/stable/how-to/writing_plugins.html#setuptools-entry-points);
  * compiled bytecode (`__pycache__`, `*.pyc`, `*.pyo`): never part of a source fix;
  * top-level modules that shadow the test runner, its dependencies or the standard
    library (`pytest.py`, `_pytest/`, `json.py` at the repository root): `python -m`
    puts the working directory first on sys.path
    (https://docs.python.org/3/using/cmdline.html#cmdoption-m).

Library code in folders named `test`/`tests`/`testing` (`django/test/utils.py`,
`numpy/testing/_private/utils.py`) is code under test and is kept.

Paths are read with `unidiff` (git, `git --no-prefix` and plain `diff -u` patches), and
the patch is applied with the same strip level (`-p0`/`-p1`) that the paths were read
with, so what is classified is what gets written.  A patch whose paths cannot be read
raises `PatchReadError`.

`apply_script` is swebench 5.0.2's order (`harness/run_evaluation.py`, `GIT_APPLY_CMDS`):
`git apply --verbose`, `--3way`, `--reject`, then `patch --batch --forward --fuzz=5`,
resetting the tree between attempts, and finally `git apply --check --reverse` to accept
an already-applied patch.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import re
import shlex
import sys
import tomllib
from pathlib import PurePosixPath

import unidiff

from app.runtimes.patch import link_escapes, symlink_refusal, symlink_target

APPLY_CMDS = (  # {p}: the strip level, -p0 or -p1
    "git apply --verbose {p}",
    "git apply --verbose --3way {p}",
    "git apply --verbose --reject {p}",
    "patch --batch --forward --fuzz=5 {p} -i",
)
APPLIED_MARKER = ">>>>> Applied Patch"
PYTEST_CONFIG_FILES = frozenset({"pytest.ini", ".pytest.ini", "tox.ini", "pytest.toml", ".pytest.toml"})
PYTEST_TABLE_FILES = frozenset({"setup.cfg", "pyproject.toml"})
STARTUP_HOOKS = frozenset({"sitecustomize.py", "usercustomize.py"})
# `python -m pytest` puts the working directory (the repository root) first on sys.path, so a
# top-level module or package named like the test runner, one of its dependencies or a standard
# library module replaces the real one for the whole test run.
TEST_RUNNER_MODULES = frozenset({"pytest", "_pytest", "py", "pluggy", "iniconfig", "packaging", "exceptiongroup",
                                 "tomli", "colorama"})
# ("test", CPython's own regression-test package, is left out: a root `test/` folder is a common
# place for a project's tests, which pytest imports by path.)
SHADOWABLE_MODULES = TEST_RUNNER_MODULES | (frozenset(sys.stdlib_module_names) - {"test"})
_METADATA_SUFFIXES = (".dist-info", ".egg-info", ".egg")
# git's default and mnemonic prefixes (diff.mnemonicPrefix): a/ b/ c/ i/ o/ w/ 1/ 2/.
_GIT_PREFIX = re.compile(r"^[abciow12]/")
_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


class PatchReadError(ValueError):
    """The patch's file paths cannot be read unambiguously; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class FileChange:
    """One file's section of a patch: its text and its paths as applied (None for /dev/null)."""

    text: str
    old: str | None
    new: str | None

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for p in (self.old, self.new) if p is not None))


@dataclasses.dataclass(frozen=True)
class ReadPatch:
    """A parsed patch: `preamble` (text before the first file), `files`, and `strip` (0 or 1),
    the number of leading path components removed when it is applied."""

    preamble: str
    files: list[FileChange]
    strip: int


def _sections(patch: str) -> tuple[str, list[str]]:
    """Split unified-diff text into (preamble, one text per file), counting hunk lines so
    that a removed line starting with `--` is never taken for a file header."""
    lines = patch.splitlines(keepends=True)
    preamble: list[str] = []
    sections: list[list[str]] = []
    git_header_open = False  # a `diff --git` section that has not had its ---/+++ yet
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        if line.startswith("diff --git "):
            sections.append([line])
            git_header_open = True
            i += 1
            continue
        if line.startswith("--- ") and i + 1 < n and lines[i + 1].startswith("+++ "):
            if not git_header_open:
                sections.append([])
            git_header_open = False
            sections[-1] += lines[i : i + 2]
            i += 2
            while i < n and lines[i].startswith("@@ "):
                m = _HUNK.match(lines[i])
                if not m:
                    break
                old_left = int(m.group(1)) if m.group(1) is not None else 1
                new_left = int(m.group(2)) if m.group(2) is not None else 1
                sections[-1].append(lines[i])
                i += 1
                while i < n and (old_left > 0 or new_left > 0):
                    body = lines[i]
                    tag = body[:1]
                    if tag in (" ", "\n", "\r"):
                        old_left, new_left = old_left - 1, new_left - 1
                    elif tag == "-":
                        old_left -= 1
                    elif tag == "+":
                        new_left -= 1
                    elif tag != "\\":
                        break
                    sections[-1].append(body)
                    i += 1
                while i < n and lines[i].startswith("\\"):
                    sections[-1].append(lines[i])
                    i += 1
            continue
        (sections[-1] if sections else preamble).append(line)
        i += 1
    return "".join(preamble), ["".join(s) for s in sections]


def _unquote(name: str) -> str:
    # git quotes names with special characters C-style ("a/x\tb"): decode them.
    if len(name) >= 2 and name[0] == name[-1] == '"':
        raw = name[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")
        return raw.encode("latin-1", "replace").decode("utf-8", "replace")
    return name


def _check_path(path: str, raw: str) -> str:
    parts = PurePosixPath(path).parts
    if not path or path.startswith("/") or ".." in parts or ".git" in parts or "\0" in path:
        raise PatchReadError(f"patch path {raw!r} is not a relative path inside the repository")
    return path


def read_patch(patch: str) -> ReadPatch:
    """Parse `patch` (unified diff text) into its file changes, with unidiff.

    The strip level is 1 when every path carries a git prefix (`a/x`, `b/x`, or a
    mnemonic prefix), 0 when none does (`git diff --no-prefix`, `diff -u x.orig x`).
    Raises `PatchReadError` when unidiff cannot parse it, when text that is not blank
    holds no file change, when prefixed and unprefixed paths are mixed, or when a path
    is absolute, climbs out (`..`) or goes into `.git`, or when it adds a symbolic link that
    points outside the repository.
    """
    if not patch or not patch.strip():
        return ReadPatch(patch or "", [], 1)
    try:
        parsed = unidiff.PatchSet(patch)
    except unidiff.UnidiffParseError as exc:
        raise PatchReadError(f"patch cannot be parsed as a unified diff: {exc}") from None
    preamble, sections = _sections(patch)
    if not parsed:
        raise PatchReadError("patch holds no file change (no `diff --git` or `---`/`+++` headers)")
    if len(parsed) != len(sections):
        raise PatchReadError(f"patch headers are ambiguous: unidiff reads {len(parsed)} file(s), "
                             f"the hunk counts give {len(sections)}")
    names = [(None if pf.source_file == "/dev/null" else _unquote(pf.source_file),
              None if pf.target_file == "/dev/null" else _unquote(pf.target_file)) for pf in parsed]
    present = [n for pair in names for n in pair if n is not None]
    prefixed = [bool(_GIT_PREFIX.match(n)) for n in present]
    if all(prefixed):
        strip = 1
    elif not any(prefixed):
        strip = 0
    else:
        raise PatchReadError("patch mixes git-prefixed (a/, b/) and unprefixed paths, so no single strip "
                             "level reads them all")
    files = []
    for text, (old, new) in zip(sections, names):
        files.append(FileChange(
            text,
            None if old is None else _check_path(old.split("/", strip)[-1] if strip else old, old),
            None if new is None else _check_path(new.split("/", strip)[-1] if strip else new, new),
        ))
    # A link out of the repository would let the tests read a host file (one rule with the
    # rollout's patch extraction: app.runtimes.patch).
    escapes = [(f.new, target) for f in files if f.new is not None
               and (target := symlink_target(f.text)) is not None and link_escapes(f.new, target)]
    if escapes:
        raise PatchReadError(symlink_refusal(escapes))
    return ReadPatch(preamble, files, strip)


def files_of_test_ids(test_ids: list[str]) -> set[str]:
    """Files named by pytest-style test ids (`tests/test_x.py::TestA::test_b[p]` → `tests/test_x.py`)."""
    out = set()
    for tid in test_ids:
        head = tid.split("::", 1)[0]
        if "::" in tid and head.endswith(".py"):
            out.add(head)
    return out


def harness_change_reason(path: str, protected: set[str]) -> str | None:
    """Why a change to `path` is not the agent's to make (see the module docstring), or None.

    `setup.cfg` and `pyproject.toml` are not judged by path: the grader puts them back whole
    after the patch is applied.  Rules that need the trees and the test environment (an
    `__init__.py` on the test path, shadowing, test helpers) are `app.grading.surface`'s.
    """
    p = PurePosixPath(path)
    if path in protected:
        return "instance test file"
    if p.name == "conftest.py" or fnmatch.fnmatch(p.name, "test_*.py") or fnmatch.fnmatch(p.name, "*_test.py"):
        return "test module"
    if p.name in PYTEST_CONFIG_FILES:
        return "pytest configuration"
    if p.name in STARTUP_HOOKS or p.suffix == ".pth":
        return "interpreter start-up hook"
    if any(part.endswith(_METADATA_SUFFIXES) for part in p.parts):
        return "package metadata (entry points)"
    top = p.parts[0] if len(p.parts) > 1 else p.name.split(".", 1)[0]
    if top in SHADOWABLE_MODULES and (len(p.parts) > 1 or p.suffix in (".py", ".so", ".pyd")):
        return "shadows the test runner or the standard library"
    if "__pycache__" in p.parts or p.suffix in (".pyc", ".pyo"):
        return "compiled bytecode"
    return None


def pytest_table_changed(name: str, base_text: str | None, new_text: str | None) -> bool:
    """True when the pytest table of `setup.cfg` (`[tool:pytest]`) or `pyproject.toml`
    (`[tool.pytest]`, `[tool.pytest.ini_options]`) differs between the two texts (None = no
    file).  A text that does not parse counts as changed.

    Read whole, with the parsers pytest uses (`_pytest/config/findpaths.py`): `iniconfig` for
    `setup.cfg` (configparser reads some texts differently, e.g. `[tool:pytest] # ]`), `tomllib`
    for `pyproject.toml`.  The grader does not rely on it: it puts both files back whole."""
    import iniconfig

    def table(text: str | None):
        if text is None:
            return None
        if name == "setup.cfg":
            ini = iniconfig.IniConfig("setup.cfg", data=text)
            return dict(ini["tool:pytest"].items()) if "tool:pytest" in ini.sections else None
        return tomllib.loads(text).get("tool", {}).get("pytest")

    try:
        return table(base_text) != table(new_text)
    except (iniconfig.ParseError, tomllib.TOMLDecodeError, AttributeError, UnicodeError):
        return True


def drop_test_changes(
    patch: str, test_files: list[str], test_patch: str = "", test_ids: list[str] = ()
) -> tuple[str, list[str]]:
    """(patch without test-harness changes, sorted list of dropped paths).

    Apply the result with the strip level `read_patch(patch).strip`.
    `test_files`, the paths `test_patch` touches and the files of `test_ids` are the
    instance's own test files.  Raises `PatchReadError` (see `read_patch`).
    """
    read = read_patch(patch)
    protected = set(test_files) | files_of_test_ids(list(test_ids))
    if test_patch and test_patch.strip():
        protected |= {p for f in read_patch(test_patch).files for p in f.paths}
    kept, dropped = [], []
    for f in read.files:
        if any(harness_change_reason(p, protected) for p in f.paths):
            dropped.extend(f.paths)
        else:
            kept.append(f.text)
    # "" when no file change is left: the preamble (a commit message, say) alone is no patch.
    return (read.preamble + "".join(kept)) if kept else "", sorted(set(dropped))


def apply_script(patch_file: str, strip: int = 1) -> str:
    """Bash that applies `patch_file` in the current repo with `-p<strip>`; prints
    `>>>>> Applied Patch (...)` or swebench's `>>>>> Patch Apply Failed` and exits 1."""
    q = shlex.quote(patch_file)
    p = f"-p{int(strip)}"
    lines = ["set -u", "ok=''"]
    for i, template in enumerate(APPLY_CMDS):
        cmd = template.format(p=p)
        reset = "git checkout -- . >/dev/null 2>&1; git clean -fdq >/dev/null 2>&1; " if i else ""
        lines.append(f'if [ -z "$ok" ]; then {reset}if {cmd} {q}; then ok={shlex.quote(cmd)}; fi; fi')
    lines += [
        f'if [ -z "$ok" ] && git apply {p} --check --reverse {q} >/dev/null 2>&1; then ok="already applied"; fi',
        f'if [ -n "$ok" ]; then echo "{APPLIED_MARKER} ($ok)"; exit 0; fi',
        'echo ">>>>> Patch Apply Failed"; exit 1',
    ]
    return "\n".join(lines) + "\n"
