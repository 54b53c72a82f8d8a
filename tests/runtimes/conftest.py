"""Fixtures shared by the runtime tests."""
import pytest

from app import config
from app.config import ROOT, get_settings


@pytest.fixture
def settings(tmp_path, monkeypatch):
    """Runtimes and DB under tmp; the content-addressed cache shared with other runs (fast setup)."""
    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("TURNSTILE_CACHE_DIR", str(ROOT / "var" / "cache"))
    config.reset_settings()
    yield get_settings()
    config.reset_settings()
