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
import json
import logging
import sys
import types
from pathlib import Path
from typing import Any, NamedTuple
from xml.sax.saxutils import escape

log = logging.getLogger(__name__)


def xml_quote(text: str) -> str:
    """`text` escaped for a double-quoted XML attribute (quotes not included)."""
    return escape(text, {'"': "&quot;"})


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


class LogLines(NamedTuple):
    """How one test runner prints a passing and a failing test, as templates for `str.format`.

    Fields a template may use: `id` (the test id as is), `id_json` (JSON string, quotes
    included), and, where `split` is set, `suite` / `name` (the id cut at the first `split`:
    the runner prints the suite on a header line and the test under it; the parser joins them
    back with `split`), `suite_xml` / `name_xml` (XML-attribute-escaped).  A template may span
    lines.  For an id without `split` (a test outside any suite) lines naming `{suite...}` are
    left out.  With `nest`, each further `split` in `name` starts a new line indented one space
    deeper than the line holding `{name}` (Mocha prints each nested describe on its own line).
    `reports_passes` is False for a parser that only ever reports failures (swebench
    grades those under `fail_only`: a test not reported FAILED counts as passed).
    """

    passed: str
    failed: str
    split: str | None = None
    reports_passes: bool = True
    nest: bool = False

    def render(self, template: str, test_id: str) -> str:
        fields = {"id": test_id, "id_json": json.dumps(test_id)}
        lines = template.split("\n")
        if self.split:
            suite, sep, name = test_id.partition(self.split)
            if not sep:
                suite, name = "", test_id
                lines = [ln for ln in lines if "{suite" not in ln]
            if self.nest and "{name" in template:
                indent = next(len(ln) - len(ln.lstrip()) for ln in lines if "{name" in ln)
                parts = name.split(self.split)
                name = "".join([parts[0]] + [f"\n{' ' * (indent + i)}{p}" for i, p in enumerate(parts[1:], 1)])
            fields |= {"suite": suite, "name": name, "suite_xml": xml_quote(suite), "name_xml": xml_quote(name)}
        return "\n".join(lines).format(**fields)


_PYTEST_LINES = LogLines("PASSED {id}", "FAILED {id} - AssertionError")
# Jest's per-file summary (`PASS path/to/file.test.js (5.2 s)`), as react-pdf, carbon, grommet read it.
_JEST_FILE_LINES = LogLines("PASS {id} (5.2 s)", "FAIL {id} (5.2 s)")
_KARMA_PROGRESS_PASS = "Chrome Headless 120.0.0.0 (Linux x86_64): Executed 1 of 1 SUCCESS (0.1 secs / 0.05 secs)"
# The line each parser's log format prints for a passing and for a failing test, by the name of
# the parser *function* (swebench's per-repo names are aliases of these: `parse_log_flask` is
# `parse_log_pytest`, `parse_log_astropy` is `parse_log_pytest_v2`, ...).  Each runner's format
# is what the parser's regexes read (swebench 5.0.2 `harness/log_parsers/*.py`).
LOG_LINES = {
    # pytest's `-rA` summary.
    "parse_log_pytest": _PYTEST_LINES, "parse_log_pytest_v2": _PYTEST_LINES,
    "parse_log_pytest_options": _PYTEST_LINES, "parse_log_matplotlib": _PYTEST_LINES,
    "parse_log_seaborn": _PYTEST_LINES,
    # Django's runner at verbosity 2 (`name (module.Class) ... ok`).
    "parse_log_django": LogLines("{id} ... ok", "{id} ... FAIL"),
    # sympy's `bin/test` (`test_name ok`, `test_name F`).
    "parse_log_sympy": LogLines("{id} ok", "{id} F"),
    # `go test -v` (`--- PASS: TestName (0.00s)`).
    "parse_log_gotest": LogLines("--- PASS: {id} (0.00s)", "--- FAIL: {id} (0.00s)"),
    # `cargo test` (`test name ... ok`).
    "parse_log_cargo": LogLines("test {id} ... ok", "test {id} ... FAILED"),
    # Jest --verbose under the traced `./node_modules/.bin/jest` command: a describe header
    # indented, then `✓ name (5ms)`; the parser joins suite and test with " - ".
    "parse_log_calypso": LogLines("+ ./node_modules/.bin/jest client\n  {suite}\n    ✓ {name} (5ms)",
                                  "+ ./node_modules/.bin/jest client\n  {suite}\n    ✕ {name} (5ms)", split=" - "),
    # Karma's progress reporter names only failures: `Chrome 120.0.0.0 (Linux x86_64) name FAILED`
    # (the parser keeps the space before FAILED in the id).
    "parse_log_chart_js": LogLines(_KARMA_PROGRESS_PASS, "Chrome 120.0.0.0 (Linux x86_64) {id}FAILED",
                                   reports_passes=False),
    "parse_log_bpmn_js": LogLines(_KARMA_PROGRESS_PASS, "HeadlessChrome 120.0.0.0 (Linux 0.0.0) {id}FAILED\n",
                                  reports_passes=False),
    "parse_log_openlayers": LogLines(_KARMA_PROGRESS_PASS, "Chrome Headless 120.0.0.0 (Linux x86_64) {id} FAILED\n",
                                     reports_passes=False),
    # Mocha's epilogue lists failures only (`1) name`); a pass prints `✓ name`, which these ignore.
    "parse_log_marked": LogLines("  ✓ {id}", "1) {id}", reports_passes=False),
    # ... with the error after it (`  1) suite test:` then `AssertionError ...`), read up to "Error".
    "parse_log_eslint": LogLines("    ✓ {id}", "  1) {id}\n     AssertionError [ERR_ASSERTION]: false == true",
                                 reports_passes=False),
    # ... nested: `  1) suite`, each inner describe and the test indented deeper, the last ending
    # in ":"; joined with ":".
    "parse_log_p5js": LogLines("    ✓ {id}", "  1) {suite}\n       {name}:\n     Error: x", split=":",
                               reports_passes=False, nest=True),
    "parse_log_react_pdf": _JEST_FILE_LINES, "parse_log_carbon": _JEST_FILE_LINES,
    "parse_log_grommet": _JEST_FILE_LINES,
    # Jest --verbose (`✓ name (5 ms)`, `✕ name (5 ms)`).
    "parse_log_jest": LogLines("  ✓ {id} (5 ms)", "  ✕ {id} (5 ms)"),
    # Jest --json piped through swebench's JEST_JSON_JQ_TRANSFORM (`[PASSED] name`).
    "parse_log_jest_json": LogLines("[PASSED] {id}", "[FAILED] {id}"),
    # Vitest --reporter=verbose (`✓ file > suite > name 2ms`, `× ...`).
    "parse_log_vitest": LogLines(" ✓ {id} 2ms", " × {id} 2ms"),
    # Karma's mocha reporter after `Starting browser`: suite indented, then `✔ name`; joined " > ".
    "parse_log_karma": LogLines("Starting browser ChromeHeadless\n  {suite}\n    ✔ {name}",
                                "Starting browser ChromeHeadless\n  {suite}\n    ✖ {name}", split=" > "),
    # TAP (`ok 1 name`, `not ok 1 name`).
    "parse_log_tap": LogLines("ok 1 {id}", "not ok 1 {id}"),
    # Mocha's spec reporter: `  suite` then `    ✓ name (5ms)` / `    1) name`; joined with ".".
    "parse_log_highlightjs": LogLines("  {suite}\n    ✓ {name} (5ms)", "  {suite}\n    1) {name}", split="."),
    # Mocha's json reporter after its command line (`{"passes": [{"fullTitle": ...}], ...}`).
    "parse_log_prismjs": LogLines(
        '+ ./node_modules/.bin/mocha tests/run.js --reporter json\n{{"failures": [], "passes": [{{"fullTitle": {id_json}}}]}}',
        '+ ./node_modules/.bin/mocha tests/run.js --reporter json\n{{"failures": [{{"fullTitle": {id_json}}}], "passes": []}}'),
    # `deno test` as quarto's smoke tests print it (`[smoke] > doc.qmd ... ok (5ms)`, status in ANSI colour).
    "parse_log_quarto_cli": LogLines("{id} ... \x1b[0m\x1b[32mok\x1b[0m \x1b[0m\x1b[38;5;245m(5ms)\x1b[0m",
                                     "{id} ... \x1b[0m\x1b[31mFAILED\x1b[0m \x1b[0m\x1b[38;5;245m(5ms)\x1b[0m"),
    # Redis's Tcl test runner (`[ok]: name (5 ms)`, `[err]: name in tests/unit/x.tcl`).
    "parse_log_redis": LogLines("[ok]: {id} (5 ms)", "[err]: {id} in tests/unit/type/list.tcl"),
    # Automake's test harness, as jq runs it (`PASS: tests/jqtest`).
    "parse_log_jq": LogLines("PASS: {id}", "FAIL: {id}"),
    # doctest's `-r=xml` reporter: <TestCase name><SubCase name> with Expressions; joined " > ".
    "parse_log_doctest": LogLines(
        '<doctest><TestSuite><TestCase name="{suite_xml}"><SubCase name="{name_xml}"><Expression success="true"/>'
        '</SubCase></TestCase></TestSuite></doctest>',
        '<doctest><TestSuite><TestCase name="{suite_xml}"><SubCase name="{name_xml}"><Expression success="false"/>'
        '</SubCase></TestCase></TestSuite></doctest>', split=" > "),
    # MicroPython's run-tests.py (`pass  basics/int.py`, `FAIL  basics/int.py`).
    "parse_log_micropython_test": LogLines("pass  {id}", "FAIL  {id}"),
    # GoogleTest (`[       OK ] Suite.Test (0 ms)`).
    "parse_log_googletest": LogLines("[       OK ] {id} (0 ms)", "[  FAILED  ] {id} (0 ms)"),
    # Maven surefire, one test per `mvn test -Dtest=...` (traced by `set -x`), then BUILD SUCCESS/FAILURE.
    "parse_log_maven": LogLines("+ mvn test -Dtest={id}\n[INFO] BUILD SUCCESS", "+ mvn test -Dtest={id}\n[INFO] BUILD FAILURE"),
    # Ant's JUnit task with a per-test formatter (`[junit] [PASS] name`).
    "parse_log_ant": LogLines("    [junit] [PASS] {id}", "    [junit] [FAIL] {id}"),
    # Gradle's test logging (`com.example.FooTest > testBar PASSED`).
    "parse_log_gradle_custom": LogLines("{id} PASSED", "{id} FAILED"),
    # PHPUnit --testdox: `Suite Name (Tests\Class)` header, then ` ✔ name`; joined " > ".
    "parse_log_phpunit": LogLines("{suite} (Tests\\Unit\\ExampleTest)\n ✔ {name}",
                                  "{suite} (Tests\\Unit\\ExampleTest)\n ✘ {name}", split=" > "),
    # Minitest -v with shoulda names, which end in ". " (`TestX#test_: x should y. = 0.00 s = .`).
    "parse_log_minitest": LogLines("{id}. = 0.00 s = .", "{id}. = 0.00 s = F"),
    # Cucumber --format progress as the parser reads it (`name ....`, `name ...F`).
    "parse_log_cucumber": LogLines("{id} ....", "{id} ...F"),
    # test-unit --verbose (`  test_x(TestY):\t.: (0.001)`).
    "parse_log_ruby_unit": LogLines("  {id}:\t.: (0.001)", "  {id}:\tF: (0.001)"),
    # RSpec --format json piped through swebench's transform (`name - passed`).
    "parse_log_rspec_transformed_json": LogLines("{id} - passed", "{id} - failed"),
}

# Parsers whose log format is chosen by the instance, not fixed: one template cannot be faithful.
UNCHECKED_PARSERS = {
    "parse_log_next": "reads Karma output for test_spec.version 1.27 and a different suite format otherwise",
    "parse_log_lighthouse": "reads Mocha, Jest or Mocha-json output by test_spec.version",
    "parse_log_immutable_js": "picks the Jest or Jest-json parser by the PR number in test_spec.instance_id",
    "parse_log_jekyll": "picks the Minitest or Cucumber parser by the PR number in test_spec.instance_id",
}


def _parser(parser: str) -> Any:
    _register_harness_stub()
    return importlib.import_module("swebench.harness.log_parsers").PARSER_REGISTRY[parser]


def log_lines(parser: str) -> LogLines | None:
    """The `LogLines` of the log format the swebench parser named `parser` reads, found through
    the function the name stands for; None for one in `UNCHECKED_PARSERS`."""
    return LOG_LINES.get(getattr(_parser(parser), "__name__", ""))


@functools.lru_cache(maxsize=None)
def _log_unchecked(parser: str, function: str) -> None:
    # Cached so that a taskset of thousands of rows logs each parser once.
    log.warning("log parser %s (%s): test ids are not checked at load, because it %s",
                parser, function, UNCHECKED_PARSERS.get(function, "has no log template"))


def unmatchable_test_ids(record: Any) -> list[tuple[str, str]]:
    """Problems with the record's test ids that its log parser can never match.

    Each FAIL_TO_PASS / PASS_TO_PASS id is written as its test runner writes a passing and a
    failing test (`LOG_LINES`, chosen by the parser function, so every per-repo alias is
    checked as the function it is) and read back with the record's own parser
    (`swebench.harness.log_parsers`), graded as swebench 5.0.2 `get_eval_tests_report` grades.
    Under `pass_and_fail` an id that does not come back as `PASSED` can never count as passing:
    the instance cannot be solved (e.g. `parse_log_pytest_v2` collapses runs of spaces,
    `parse_log_matplotlib` and `parse_log_seaborn` cut an id at its first space; a parser that
    reports only failures never passes any).  Under `fail_only` an id that does not come back
    as `FAILED` from a failing run counts as passing while it fails (a pytest FAILED line is
    cut at its first " - "), and one read as `FAILED` from a passing run can never pass.
    Returns one (field, message) per such id; [] for a parser in `UNCHECKED_PARSERS`, which is
    logged once per parser name.
    """
    lines = log_lines(record.log_parser)
    if lines is None:
        _log_unchecked(record.log_parser, getattr(_parser(record.log_parser), "__name__", ""))
        return []
    parse = _parser(record.log_parser)
    problems = []
    for field in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        for test_id in getattr(record, field):
            passed = parse(lines.render(lines.passed, test_id), None)
            if record.eval_type == "fail_only":
                if passed.get(test_id) == "FAILED":
                    problems.append((field, f"id {test_id!r} is read by {record.log_parser} as FAILED from a "
                                            "passing run, so it can never pass"))
                elif parse(lines.render(lines.failed, test_id), None).get(test_id) != "FAILED":
                    problems.append((field, f"id {test_id!r}: a failing run is read by {record.log_parser} under "
                                            f"a different id, and fail_only would count it as passed"))
            elif passed.get(test_id) != "PASSED":
                problems.append((field, f"id {test_id!r} is read back by {record.log_parser} as "
                                        f"{sorted(passed)!r}, so it can never pass"))
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
