"""Import swebench 5.0.2's grader without docker, and build its `TestSpec` from a record.

`swebench/harness/__init__.py` imports `docker_utils` and `modal_eval` (docker,
modal, datasets), and `harness/utils.py` imports `datasets` at module level.  The
grading code itself (`harness/grading.py`, `harness/log_parsers/`,
`harness/constants/`) needs none of them.  So before the first import we register
an empty module object for `swebench.harness` whose `__path__` is the installed
folder: submodules then import normally and the heavy `__init__` never runs.
It lives with the task sets because both the record schema (valid `log_parser` names)
and the grader (`app.grading`) use it.

`record_test_exit_code` and `parse_eval_script` live in `harness/utils.py`, which
we cannot import; `eval_script_lines` reproduces them line for line (source:
swebench 5.0.2 `harness/utils.py`).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any


def _register_harness_stub() -> None:
    if "swebench.harness" in sys.modules:
        return
    spec = importlib.util.find_spec("swebench")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the `swebench` package is not installed (pip install --no-deps swebench==5.0.2 unidiff)")
    harness_dir = Path(list(spec.submodule_search_locations)[0]) / "harness"
    stub = types.ModuleType("swebench.harness")
    stub.__path__ = [str(harness_dir)]  # submodules resolve here; __init__ is never executed
    stub.__package__ = "swebench.harness"
    sys.modules["swebench.harness"] = stub
    importlib.import_module("swebench")


@functools.lru_cache(maxsize=1)
def grading_module() -> types.ModuleType:
    """`swebench.harness.grading` (get_logs_eval, get_eval_report, get_eval_tests_report)."""
    _register_harness_stub()
    return importlib.import_module("swebench.harness.grading")


@functools.lru_cache(maxsize=1)
def constants_module() -> types.ModuleType:
    _register_harness_stub()
    return importlib.import_module("swebench.harness.constants")


@functools.lru_cache(maxsize=1)
def parser_names() -> frozenset[str]:
    """Keys of swebench's `PARSER_REGISTRY` (valid `log_parser` values)."""
    _register_harness_stub()
    return frozenset(importlib.import_module("swebench.harness.log_parsers").PARSER_REGISTRY)


# The line each parser's log format prints for a passing and for a failing test, by the name of
# the parser *function* (swebench's per-repo names are aliases of these: `parse_log_flask` is
# `parse_log_pytest`, `parse_log_astropy` is `parse_log_pytest_v2`, `parse_log_requests` is
# `parse_log_pytest_options`, ...).  Sources: pytest's `-rA` summary; Django's runner at
# verbosity 2 (`name (module.Class) ... ok`); sympy's `bin/test` (`test_name ok`, `test_name F`);
# `go test -v` (`--- PASS: TestName (0.00s)`); `cargo test` (`test name ... ok`).
_PYTEST_LINES = ("PASSED {id}", "FAILED {id} - AssertionError")
LOG_LINES = {
    "parse_log_pytest": _PYTEST_LINES, "parse_log_pytest_v2": _PYTEST_LINES,
    "parse_log_pytest_options": _PYTEST_LINES, "parse_log_matplotlib": _PYTEST_LINES,
    "parse_log_seaborn": _PYTEST_LINES,
    "parse_log_django": ("{id} ... ok", "{id} ... FAIL"),
    "parse_log_sympy": ("{id} ok", "{id} F"),
    "parse_log_gotest": ("--- PASS: {id} (0.00s)", "--- FAIL: {id} (0.00s)"),
    "parse_log_cargo": ("test {id} ... ok", "test {id} ... FAILED"),
}


def log_lines(parser: str) -> tuple[str, str] | None:
    """(passing line, failing line) templates (`{id}`) of the log format the swebench parser
    named `parser` reads, found through the function the name stands for; None for a format
    with no template here."""
    _register_harness_stub()
    func = importlib.import_module("swebench.harness.log_parsers").PARSER_REGISTRY[parser]
    return LOG_LINES.get(getattr(func, "__name__", ""))


def unmatchable_test_ids(record: Any) -> list[tuple[str, str]]:
    """Problems with the record's test ids that its log parser can never match.

    Each FAIL_TO_PASS / PASS_TO_PASS id is written as its test runner writes a passing and a
    failing test (`LOG_LINES`, chosen by the parser function, so every per-repo alias is
    checked as the function it is) and read back with the record's own parser
    (`swebench.harness.log_parsers`).  An id that does not come back as `PASSED` can never
    count as passing: the instance cannot be solved (e.g. `parse_log_pytest_v2` collapses
    runs of spaces, `parse_log_matplotlib` and `parse_log_seaborn` cut an id at its first space).
    Under `fail_only` an id that does not come back as `FAILED` counts as passing while it fails
    (a pytest FAILED line is cut at its first " - ").  Returns one (field, message) per such id;
    [] for a parser whose log format has no template here (`log_lines` is None: JavaScript,
    Java, Ruby, PHP and C runners), which is not checked.
    """
    lines = log_lines(record.log_parser)
    if lines is None:
        return []
    passed_line, failed_line = lines
    parse = importlib.import_module("swebench.harness.log_parsers").PARSER_REGISTRY[record.log_parser]
    problems = []
    for field in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        for test_id in getattr(record, field):
            passed = parse(passed_line.format(id=test_id), None)
            if passed.get(test_id) != "PASSED":
                problems.append((field, f"id {test_id!r} is read back by {record.log_parser} as "
                                        f"{sorted(passed)!r}, so it can never pass"))
            elif record.eval_type == "fail_only" and parse(failed_line.format(id=test_id), None).get(test_id) != "FAILED":
                problems.append((field, f"id {test_id!r}: a failing run is read by {record.log_parser} under "
                                        f"a different id, and fail_only would count it as passed"))
    return problems


def eval_script_lines(eval_script: str) -> list[str]:
    """The record's eval script as swebench's `make_test_spec` stores it.

    Drops the shebang and `set -uxo pipefail` lines (`parse_eval_script`), then
    stores `$?` of the test command in `SWEBENCH_TEST_EXIT_CODE` right before the
    `: '>>>>> End Test Output'` line and echoes `>>>>> Test Exit Code: N` right
    after it (`record_test_exit_code`), so the anti-spoofing check in
    `get_logs_eval` can compare the log with the real exit status.
    """
    c = constants_module()
    lines = [ln for ln in eval_script.strip().split("\n") if ln not in ("#!/bin/bash", "set -uxo pipefail")]
    for i, line in enumerate(lines):
        if c.END_TEST_OUTPUT in line:
            return [
                *lines[:i],
                f"{c.TEST_EXIT_CODE_VAR}=$?",
                line,
                f'echo "{c.TEST_EXIT_CODE}: ${c.TEST_EXIT_CODE_VAR}"',
                *lines[i + 1 :],
            ]
    return lines


def default_eval_script(record: Any) -> str:
    """An eval script (reset the test files, then run `test_cmd`) for a record that has only `test_cmd`.

    BASE is the repository's root commit for sdist and inline sources, `base_commit` for git ones.
    """
    files = " ".join(record.test_files)
    base = '$(git rev-list --max-parents=0 HEAD | tail -n 1)' if record.source_kind in ("pypi_sdist", "inline") else record.base_commit
    lines = ["#!/bin/bash", "set -uxo pipefail", f"BASE={base}", "git status --short"]
    if files:
        lines.append(f'git checkout "$BASE" -- {files}')
    if record.test_patch:
        lines += ["git apply -v - <<'EOF_SWEBENCH_TEST_PATCH'", record.test_patch.rstrip("\n"), "EOF_SWEBENCH_TEST_PATCH"]
    lines += [": '>>>>> Start Test Output'", record.test_cmd, ": '>>>>> End Test Output'"]
    if files:
        lines.append(f'git checkout "$BASE" -- {files}')
    return "\n".join(lines) + "\n"


def make_test_spec(record: Any) -> Any:
    """`swebench.types.TestSpec` for an `InstanceRecord` (what `make_test_spec` would build)."""
    _register_harness_stub()
    from swebench.types import TestSpec

    script = record.eval_script or default_eval_script(record)
    return TestSpec(
        instance_id=record.instance_id,
        image=record.image,
        eval_script_list=eval_script_lines(script),
        repo=record.repo,
        version=record.version,
        FAIL_TO_PASS=list(record.FAIL_TO_PASS),
        PASS_TO_PASS=list(record.PASS_TO_PASS),
        log_parser=record.log_parser,
        eval_type=record.eval_type,
    )
