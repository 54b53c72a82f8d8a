"""`support.caches.fill_runtime_caches`: after it, a prepare that cannot reach the package index
(as on the multi-host test's machines) builds nothing and succeeds; in an empty cache the same
prepare fails on its download.  Both caches are fresh folders: nothing an earlier test left counts."""
from __future__ import annotations

import pytest

from app import config
from app.config import get_settings
from app.runtimes import LocalRuntime, RuntimeSetupError
from app.tasksets import load_task_set
from support.caches import fill_runtime_caches

INSTANCE = "synthetic__inflection-1"


def _offline_settings(monkeypatch, tmp_path, cache):
    """Settings of a worker whose package index is a closed port (pip reads PIP_INDEX_URL too)."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("TURNSTILE_CACHE_DIR", str(cache))
    config.reset_settings()
    return get_settings()


def test_a_filled_cache_prepares_without_the_index_and_an_empty_one_does_not(tmp_path, monkeypatch):
    record = load_task_set("synthetic").get(INSTANCE)
    filled, empty = tmp_path / "filled", tmp_path / "empty"
    [env] = fill_runtime_caches("synthetic", [INSTANCE], filled)  # here the index is reachable
    assert (env / "READY").exists()
    assert [p.name for p in (filled / "sdists" / record.source.sha256).iterdir()] == [record.source.filename]
    try:
        with LocalRuntime.prepare(record, settings=_offline_settings(monkeypatch, tmp_path, filled)) as rt:
            assert rt.run("python -c 'import inflection; print(inflection.__version__)'").stdout.strip() == "0.5.1"
        with pytest.raises(RuntimeSetupError, match="download"):
            LocalRuntime.prepare(record, settings=_offline_settings(monkeypatch, tmp_path, empty))
    finally:
        config.reset_settings()
