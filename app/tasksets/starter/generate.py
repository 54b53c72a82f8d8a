"""Build the starter records (SWE-bench format) from the bugs table and write data/tasks/starter.jsonl.

    python -m app.tasksets.starter            # writes data/tasks/starter.jsonl
    python -m app.tasksets.starter --check    # exit 1 when the bundled file differs from what it would write

FAIL_TO_PASS and PASS_TO_PASS are not written by hand: they are read from pytest runs of the
clean and the buggy tree (FAIL_TO_PASS: passes clean, fails buggy; PASS_TO_PASS: passes both).
The base commit is the one `app.runtimes.materialize` builds for the same files and bug_patch.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from app.gitutil import SDIST_IDENTITY, git, git_env, write_excludes
from app.tasksets.starter.bugs import BUGS, MODULES, Bug, package_files, problem_statement
from app.tasksets.starter.splits import split_ids

OUT = Path(__file__).resolve().parents[3] / "data" / "tasks" / "starter.jsonl"
VERSION = "1.0.0"
PYTEST_PIN = "pytest==8.3.4"
CREATED_AT = "2026-11-30T00:00:00+00:00"


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")


def _buggy_files(bug: Bug) -> dict[str, str]:
    files = package_files(bug.package)
    module = MODULES[bug.package]
    line = f"    {bug.good}\n"
    if files[module].count(line) != 1:
        raise ValueError(f"{bug.instance_id}: line {bug.good!r} must occur exactly once in {module}")
    files[module] = files[module].replace(line, f"    {bug.bad}\n")
    if sum(text.count(f"    {bug.bad}\n") for text in files.values()) != 1:
        raise ValueError(f"{bug.instance_id}: the buggy line {bug.bad!r} must be unique in the package")
    return files


def test_scripts(test_file: str) -> tuple[str, str]:
    """(test_cmd, eval_script) of a generated instance whose tests are `test_file`: the eval script
    (bash, in SWE-bench's shape) puts the test file back to the base commit's before and after the
    run and fences pytest's report with the `>>>>> Start/End Test Output` markers the log parsers
    look for."""
    test_cmd = f"python -m pytest -rA -p no:cacheprovider --color=no {test_file}"
    eval_script = "\n".join([
        "#!/bin/bash", "set -uxo pipefail", "# run from the repository root with the instance's venv first on PATH",
        "BASE=$(git rev-list --max-parents=0 HEAD | tail -n 1)", "git status --short",
        'git -c core.fileMode=false diff "$BASE"', f'git checkout "$BASE" -- {test_file}',
        ": '>>>>> Start Test Output'", test_cmd, ": '>>>>> End Test Output'", f'git checkout "$BASE" -- {test_file}', ""])
    return test_cmd, eval_script


def _diff(before: dict[str, str], after: dict[str, str]) -> str:
    """`git diff` (a/ b/ prefixes, index line) from the `before` tree to the `after` tree."""
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        git(repo, "init", "-q", "-b", "main")
        _write(repo, before)
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", "before", extra_env=SDIST_IDENTITY)
        _write(repo, after)
        return git(repo, "diff").stdout


def _test_outcomes(files: dict[str, str], test_file: str, plugins: bool = True) -> dict[str, str]:
    """{test id: "PASSED"|"FAILED"|...} from `pytest -rA` on the tree `files` (this interpreter's pytest).

    `plugins=False` sets PYTEST_DISABLE_PLUGIN_AUTOLOAD (the instance venv has no plugins either;
    loading this venv's took ~12 of 14 s per run on a loaded 2-core box).
    """
    env = {**git_env(), "PYTHONDONTWRITEBYTECODE": "1", **({} if plugins else {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})}
    with tempfile.TemporaryDirectory() as tmp:
        _write(Path(tmp), files)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "--color=no", test_file],
                              cwd=tmp, capture_output=True, text=True, env=env)
    out = {}
    for line in proc.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR") and "::" in rest:
            out[rest.split(" - ")[0].strip()] = word
    if not out:
        raise RuntimeError(f"pytest reported no test outcome:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return out


def _base_commit(name: str, files: dict[str, str], bug_patch: str) -> str:
    """The commit id `app.runtimes.materialize` will build for these files + bug_patch."""
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        _write(repo, dict(sorted(files.items())))
        git(repo, "init", "-q", "-b", "main")
        write_excludes(repo)
        git(repo, "apply", "--whitespace=nowarn", "-", input=bug_patch)
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", f"{name} {VERSION}", extra_env=SDIST_IDENTITY)
        return git(repo, "rev-parse", "HEAD").stdout.strip()


def build_record(bug: Bug) -> dict:
    """The SWE-bench-format record of one bug (see the module docstring)."""
    clean = package_files(bug.package)
    buggy = _buggy_files(bug)
    test_file = f"test_{bug.package}.py"
    bug_patch, gold = _diff(clean, buggy), _diff(buggy, clean)
    good, bad = _test_outcomes(clean, test_file), _test_outcomes(buggy, test_file)
    if any(v != "PASSED" for v in good.values()):
        raise RuntimeError(f"{bug.instance_id}: the clean package fails its own tests: {good}")
    f2p = sorted(t for t in good if bad.get(t) != "PASSED")
    p2p = sorted(t for t in good if bad.get(t) == "PASSED")
    if not f2p:
        raise RuntimeError(f"{bug.instance_id}: no test catches the bug")
    test_cmd, eval_script = test_scripts(test_file)
    commit = _base_commit(bug.package, clean, bug_patch)
    return {
        "instance_id": bug.instance_id, "repo": f"turnstile-starter/{bug.package}", "base_commit": commit,
        "patch": gold, "test_patch": "", "problem_statement": problem_statement(bug), "hints_text": "",
        "created_at": CREATED_AT, "version": VERSION, "FAIL_TO_PASS": json.dumps(f2p), "PASS_TO_PASS": json.dumps(p2p),
        "environment_setup_commit": commit, "image": "", "eval_script": eval_script,
        "log_parser": "parse_log_pytest_v2", "eval_type": "pass_and_fail",
        "install": [f"python -m pip install -q {PYTEST_PIN}"], "test_cmd": test_cmd, "test_files": [test_file],
        "python": "3.11", "source": {"kind": "inline", "name": bug.package, "version": VERSION, "files": clean},
        "bug_patch": bug_patch, "difficulty": "starter-" + bug.hint, "split": bug.split,
        # Frozen with the published records (the generator has since moved to app/tasksets/starter/):
        # the bundled JSONL stays byte-identical, so existing base commits and caches stay valid.
        "provenance": "Generated by app/cli/starter.py: a one-line bug in a small generated package; "
                      "FAIL_TO_PASS / PASS_TO_PASS read from pytest runs of the clean and buggy trees.",
        "sdist_base_commit": commit,
    }


def build_all() -> list[dict]:
    """Every bug's record, in `BUGS` order; raises ValueError for a bug whose lines are not unique."""
    for bug in BUGS:  # every bug's lines checked before any (slow) pytest run
        _buggy_files(bug)
    return [build_record(bug) for bug in BUGS]


def render(records: list[dict]) -> str:
    """The JSONL text of `records`: one JSON object per line, keys in record order."""
    return "".join(json.dumps(r, sort_keys=False) + "\n" for r in records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.tasksets.starter", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--check", action="store_true", help="exit 1 when --out differs from what would be written")
    parser.add_argument("--ids", choices=("train", "heldout"), help="print the ids of one split of --out, comma-separated")
    args = parser.parse_args(argv)
    if args.ids:
        records = [json.loads(line) for line in args.out.read_text(encoding="utf-8").splitlines() if line.strip()]
        print(",".join(split_ids(records, args.ids)))
        return 0
    text = render(build_all())
    if args.check:
        same = args.out.exists() and args.out.read_text(encoding="utf-8") == text
        print(f"{args.out}: {'up to date' if same else 'differs from the generator'}")
        return 0 if same else 1
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {len(BUGS)} instances to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
