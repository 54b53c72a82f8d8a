"""`python -m app tasks validate SET`: gold and empty patch graded per instance; bad instances listed."""
from __future__ import annotations

import json

import pytest

from app import config
from app.cli import main
from app.config import ROOT
from app.runtimes import bwrap_available
from app.tasksets import load_task_set

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap (Debian package `bubblewrap`) is not installed/usable here")


def test_validate_lists_an_instance_that_cannot_be_solved(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("TURNSTILE_CACHE_DIR", str(ROOT / "var" / "cache"))
    config.reset_settings()
    ts = load_task_set("synthetic")
    good = ts.raw[ts.instances.index(ts.get("synthetic__inflection-2"))]
    never = "test_inflection.py::test_that_does_not_exist"
    bad = good | {"instance_id": "synthetic__inflection-2-bad",
                  "FAIL_TO_PASS": json.dumps(json.loads(good["FAIL_TO_PASS"]) + [never])}
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    try:
        assert main(["tasks", "validate", str(path)]) == 1
    finally:
        config.reset_settings()
    out = capsys.readouterr().out
    assert "ok   synthetic__inflection-2: gold resolves, empty does not" in out
    assert "BAD  synthetic__inflection-2-bad" in out
    assert f"cannot be solved: the gold patch does not resolve it (failing: {never}" in out
    assert f"1 FAIL_TO_PASS id(s) never appear in the gold run's test log: {never}" in out
    assert "1 of 2 instance(s) sound; cannot be solved: 1 (synthetic__inflection-2-bad); solved by an empty patch: 0" in out
