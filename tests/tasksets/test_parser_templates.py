"""Every distinct log-parser function in swebench's `PARSER_REGISTRY` has a template pair
(`LOG_LINES`) or is named in `UNCHECKED_PARSERS` with its reason, and each template writes a
typical id of its ecosystem so that the parser reads it back: PASSED from the passing line,
FAILED from the failing one (for a parser that only reports failures: not FAILED from the
passing line).  A template that its own parser cannot read would reject good rows at load.
"""
from __future__ import annotations

import importlib
import logging

import pytest

from app.tasksets.schema import InstanceRecord
from app.tasksets.swebench_compat import LOG_LINES, UNCHECKED_PARSERS, _log_unchecked, _register_harness_stub

# A typical FAIL_TO_PASS id as each parser function reports it (SWE-bench / multilingual style).
TYPICAL_IDS = {
    "parse_log_pytest": "tests/test_app.py::test_run[a-b]", "parse_log_pytest_v2": "tests/test_app.py::test_run[a b]",
    "parse_log_pytest_options": "tests/test_app.py::test_run", "parse_log_matplotlib": "lib/t.py::test_x[png]",
    "parse_log_seaborn": "tests/test_core.py::TestX::test_y", "parse_log_django": "test_x (app.tests.T)",
    "parse_log_sympy": "test_x", "parse_log_gotest": "TestX/sub_case", "parse_log_cargo": "mod::tests::t",
    "parse_log_calypso": "client/state - returns the site", "parse_log_chart_js": "Chart.controllers.bar should draw ",
    "parse_log_bpmn_js": "features/modeling should move shape ", "parse_log_openlayers": "ol.Map constructor works",
    "parse_log_marked": "should parse em", "parse_log_eslint": "no-unused-vars valid code:",
    "parse_log_p5js": "p5.Color:should create a color", "parse_log_react_pdf": "packages/layout/tests/text.test.js",
    "parse_log_carbon": "packages/react/src/Button-test.js", "parse_log_grommet": "src/js/Box/__tests__/Box-test.tsx",
    "parse_log_jest": "renders the button", "parse_log_jest_json": "Seq > works with \"quotes\"",
    "parse_log_vitest": "packages/runtime-core/__tests__/h.spec.ts > renderer: h > type only",
    "parse_log_karma": "render() > should render a div", "parse_log_tap": "Vector3 - clone",
    "parse_log_highlightjs": "markup.xml.should handle 1.5 ms", "parse_log_prismjs": "json - \"feature\" tokens",
    "parse_log_quarto_cli": "[smoke] > render: docx.qmd", "parse_log_redis": "LPOS basic usage",
    "parse_log_jq": "tests/jqtest", "parse_log_doctest": "json parse <a & b> > parses \"x\"",
    "parse_log_micropython_test": "basics/int_big.py", "parse_log_googletest": "FormatTest.Escape",
    "parse_log_maven": "com.google.gson.GsonTest#testBuilder", "parse_log_ant": "lombok.TestJavac#testGetter",
    "parse_log_gradle_custom": "org.apache.lucene.TestX > testY", "parse_log_phpunit": "Cell Address > Valid range",
    "parse_log_minitest": "TestFilters#test_: filters should convert", "parse_log_cucumber": "Rendering a post",
    "parse_log_ruby_unit": "test_emit(TestOutput)", "parse_log_rspec_transformed_json": "Fastlane::Action runs",
}


def registry_functions() -> dict[str, str]:
    """{function name: one registry name standing for it}."""
    _register_harness_stub()
    registry = importlib.import_module("swebench.harness.log_parsers").PARSER_REGISTRY
    return {func.__name__: name for name, func in sorted(registry.items(), reverse=True)}


FUNCTIONS = registry_functions()


def test_every_parser_function_has_a_template_or_a_reason():
    assert len(FUNCTIONS) >= 40
    for function in FUNCTIONS:
        assert function in LOG_LINES or UNCHECKED_PARSERS.get(function, "").strip(), function
        assert not (function in LOG_LINES and function in UNCHECKED_PARSERS), function
    assert set(LOG_LINES) | set(UNCHECKED_PARSERS) <= set(FUNCTIONS)  # no stale names


@pytest.mark.parametrize("function", sorted(set(FUNCTIONS) & set(LOG_LINES)))
def test_a_typical_id_reads_back_from_its_template(function):
    _register_harness_stub()
    parse = importlib.import_module("swebench.harness.log_parsers").PARSER_REGISTRY[FUNCTIONS[function]]
    lines, test_id = LOG_LINES[function], TYPICAL_IDS[function]
    passed = parse(lines.render(lines.passed, test_id), None)
    failed = parse(lines.render(lines.failed, test_id), None)
    if lines.reports_passes:
        assert passed.get(test_id) == "PASSED", passed
    else:
        assert passed.get(test_id) != "FAILED", passed
    assert failed.get(test_id) == "FAILED", failed


@pytest.mark.parametrize("test_id", ["Calculation:p5.prototype.abs:should return a number", "Color:works"])
def test_nested_mocha_describes_read_back_whole(test_id):
    """p5.js ids join every describe level with ":"; each level is printed on its own line."""
    _register_harness_stub()
    parse = importlib.import_module("swebench.harness.log_parsers").PARSER_REGISTRY["parse_log_p5js"]
    lines = LOG_LINES["parse_log_p5js"]
    assert parse(lines.render(lines.failed, test_id), None) == {test_id: "FAILED"}


def row(parser: str, test_id: str, eval_type: str) -> dict:
    return {"instance_id": "demo__pkg-1", "repo": "demo/pkg", "base_commit": "a" * 40, "patch": "x",
            "problem_statement": "p", "FAIL_TO_PASS": [test_id], "PASS_TO_PASS": [], "test_cmd": "run",
            "log_parser": parser, "eval_type": eval_type}


@pytest.mark.parametrize("parser, test_id, eval_type, why", [
    ("parse_log_maven", "com.x.T#test a", "pass_and_fail", "['com.x.T#test']"),  # -Dtest= ends at a space
    ("parse_log_phpunit", "no suite here", "pass_and_fail", "can never pass"),  # testdox ids are "Suite > test"
    ("parse_log_eslint", "rule valid:", "pass_and_fail", "can never pass"),  # reports failures only
    ("parse_log_openlayers", "ol.Map  twice", "fail_only", "different id"),  # runs of spaces collapse
])
def test_a_multilingual_id_the_parser_never_reads_back_is_named_at_load(parser, test_id, eval_type, why):
    with pytest.raises(ValueError) as info:
        InstanceRecord.model_validate(row(parser, test_id, eval_type))
    assert repr(test_id) in str(info.value) and why in str(info.value)


def test_an_unchecked_parser_loads_and_is_logged_once(caplog):
    _log_unchecked.cache_clear()  # another test in this process may have logged it already
    with caplog.at_level(logging.WARNING, logger="app.tasksets.swebench_compat"):
        for n in range(3):
            InstanceRecord.model_validate(row("parse_log_jekyll", f"TestX#test_{n}", "pass_and_fail"))
    logged = [r.getMessage() for r in caplog.records if "parse_log_jekyll" in r.getMessage()]
    assert len(logged) == 1 and "instance_id" in logged[0], logged
