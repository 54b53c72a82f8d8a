"""Every swebench log parser, per-repo aliases included, is asked at load whether it can read a
row's test ids back: a row whose ids its parser never reports as PASSED is named, not loaded.

Before, only parsers whose name starts `parse_log_pytest` were checked, so a SWE-bench row of
marshmallow, flask or requests (`parse_log_marshmallow`, `_flask`, `_requests`: aliases of the
pytest parsers), of astropy (`parse_log_astropy` = `parse_log_pytest_v2`), of Django or of sympy
loaded with an id that could never pass, and trained as an unsolvable instance.
"""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.tasksets.schema import InstanceRecord
from app.tasksets.swebench_compat import LOG_LINES, log_lines, parser_names


def row(parser: str, test_id: str, eval_type: str = "pass_and_fail") -> dict:
    return {"instance_id": "demo__pkg-1", "repo": "demo/pkg", "base_commit": "a" * 40, "patch": "x",
            "problem_statement": "p", "FAIL_TO_PASS": [test_id], "PASS_TO_PASS": [], "test_cmd": "run",
            "log_parser": parser, "eval_type": eval_type}


@pytest.mark.parametrize("parser, bad, why", [
    ("parse_log_marshmallow", "tests/test_x.py::test_y[a b]", "['tests/test_x.py::test_y[a']"),
    ("parse_log_flask", "tests/test_x.py::test_y[a b]", "['tests/test_x.py::test_y[a']"),
    ("parse_log_requests", "tests/test_x.py::test_y[a b]", "can never pass"),
    ("parse_log_astropy", "t.py::test_b[a  b]", "['t.py::test_b[a b]']"),
    ("parse_log_seaborn", "tests/t.py::test_x[a b]", "can never pass"),
    ("parse_log_matplotlib", "t.py::test_x[MouseButton.LEFT]", "['t.py::test_x[1]']"),
    ("parse_log_django", " test_x (app.tests.T)", "can never pass"),
    ("parse_log_sympy", "check_x", "can never pass"),
])
def test_an_id_the_parser_never_reads_back_is_named_at_load(parser, bad, why):
    with pytest.raises(ValidationError) as info:
        InstanceRecord.model_validate(row(parser, bad))
    assert repr(bad) in str(info.value) and parser in str(info.value) and why in str(info.value)


@pytest.mark.parametrize("parser, good", [
    ("parse_log_marshmallow", "tests/test_x.py::test_y[a-b]"), ("parse_log_requests", "tests/t.py::test_y"),
    ("parse_log_astropy", "astropy/t.py::test_b[a b]"), ("parse_log_django", "test_x (app.tests.T)"),
    ("parse_log_django", "A docstring's first line"), ("parse_log_sympy", "test_x"),
    ("parse_log_gotest", "TestX/sub"), ("parse_log_cargo", "mod::tests::t"),
])
def test_ids_the_parser_reads_back_load(parser, good):
    for eval_type in ("pass_and_fail", "fail_only"):
        assert InstanceRecord.model_validate(row(parser, good, eval_type)).FAIL_TO_PASS == [good]


def test_every_python_parser_and_alias_has_a_log_format():
    """swebench's Python parsers (every name in its registry from log_parsers/python.py) each
    map to a template, so none escapes the check."""
    import importlib

    from app.tasksets.swebench_compat import _register_harness_stub

    _register_harness_stub()
    registry = importlib.import_module("swebench.harness.log_parsers").PARSER_REGISTRY
    python = [n for n in parser_names() if registry[n].__module__.endswith(".python")]
    assert len(python) >= 20  # the aliases included
    assert [n for n in python if log_lines(n) is None] == []
    assert set(LOG_LINES) >= {registry[n].__name__ for n in python}
