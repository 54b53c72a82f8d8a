"""Fixtures shared by the grading tests."""
from __future__ import annotations

import pytest

from app import config
from app.config import ROOT, get_settings


@pytest.fixture(scope="module")
def grading_settings(tmp_path_factory):
    """Settings with a var folder of the test module's own (grade logs, workspaces) and the repository's
    shared cache (task bases and venvs are slow to build, and only read by a grade); one per test module.
    The settings are reset on the way in and out, so code that calls `get_settings()` sees the same."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TURNSTILE_VAR_DIR", str(tmp_path_factory.mktemp("var")))
        mp.setenv("TURNSTILE_CACHE_DIR", str(ROOT / "var" / "cache"))
        config.reset_settings()
        yield get_settings()
    config.reset_settings()
