"""Prepare an agent patch for grading: drop test-file changes, and the SWE-bench apply chain.

`drop_test_changes` removes, file by file, every change to a test file before
the patch is applied: the record's `test_files`, every file `test_patch`
touches, any `conftest.py`, files under a `tests`/`test`/`testing` folder and
files named `test_*.py` / `*_test.py`.  The eval script restores the test files
it runs anyway, but it would not delete a *new* `conftest.py`, which could
rewrite results (../shared/tasks/README.md section 4, last caveat).

`apply_script` is swebench 5.0.2's order (`harness/run_evaluation.py`,
`GIT_APPLY_CMDS`): `git apply --verbose`, `--3way`, `--reject`, then
`patch --batch --forward --fuzz=5 -p1`, resetting the tree between attempts,
and finally `git apply --check --reverse` to accept an already-applied patch.
"""
from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import PurePosixPath

APPLY_CMDS = (
    "git apply --verbose",
    "git apply --verbose --3way",
    "git apply --verbose --reject",
    "patch --batch --forward --fuzz=5 -p1 -i",
)
APPLIED_MARKER = ">>>>> Applied Patch"
_HEADER = re.compile(r"^diff --git (?:\"?a/(.+?)\"?) (?:\"?b/(.+?)\"?)$", re.M)
_TEST_DIRS = {"tests", "test", "testing"}


def touched_paths(patch: str) -> set[str]:
    """Paths (old and new) named in a git-format patch's `diff --git` headers."""
    out: set[str] = set()
    for a, b in _HEADER.findall(patch or ""):
        out.update((a, b))
    return out


def is_test_path(path: str, protected: set[str]) -> bool:
    p = PurePosixPath(path)
    return (
        path in protected
        or p.name == "conftest.py"
        or any(part in _TEST_DIRS for part in p.parts[:-1])
        or fnmatch.fnmatch(p.name, "test_*.py")
        or fnmatch.fnmatch(p.name, "*_test.py")
    )


def drop_test_changes(patch: str, test_files: list[str], test_patch: str = "") -> tuple[str, list[str]]:
    """(patch without test-file changes, sorted list of dropped paths).

    Works on git-format patches (`diff --git` sections); a patch without such
    headers is returned unchanged.
    """
    if not patch or "diff --git " not in patch:
        return patch or "", []
    protected = set(test_files) | touched_paths(test_patch)
    starts = [m.start() for m in re.finditer(r"^diff --git ", patch, flags=re.M)]
    head = patch[: starts[0]]
    kept, dropped = [head] if head.strip() else [], []
    for i, start in enumerate(starts):
        chunk = patch[start : starts[i + 1] if i + 1 < len(starts) else len(patch)]
        m = _HEADER.match(chunk.splitlines()[0])
        paths = set(m.groups()) if m else set()
        if paths and any(is_test_path(p, protected) for p in paths):
            dropped.extend(sorted(paths))
        else:
            kept.append(chunk)
    return "".join(kept), sorted(set(dropped))


def apply_script(patch_file: str) -> str:
    """Bash that applies `patch_file` in the current repo; prints `>>>>> Applied Patch (...)` or
    swebench's `>>>>> Patch Apply Failed` and exits 1."""
    q = shlex.quote(patch_file)
    lines = ["set -u", "ok=''"]
    for i, cmd in enumerate(APPLY_CMDS):
        reset = "git checkout -- . >/dev/null 2>&1; git clean -fdq >/dev/null 2>&1; " if i else ""
        lines.append(f'if [ -z "$ok" ]; then {reset}if {cmd} {q}; then ok={shlex.quote(cmd)}; fi; fi')
    lines += [
        f'if [ -z "$ok" ] && git apply --check --reverse {q} >/dev/null 2>&1; then ok="already applied"; fi',
        f'if [ -n "$ok" ]; then echo "{APPLIED_MARKER} ($ok)"; exit 0; fi',
        'echo ">>>>> Patch Apply Failed"; exit 1',
    ]
    return "\n".join(lines) + "\n"
