"""`harness check --pipeline` for every installed harness, for real: REST API (gunicorn) -> Celery worker
-> sandboxed runtime of a bundled task instance -> harness CLI -> gateway (gunicorn) -> scripted engine,
then grading and prefix-merged trajectories.  One collect run per harness, all submitted together.

Redis DB 15 holds the queues (flushed); the database is a fresh SQLite file.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from app.conformance.pipeline_check import run_pipeline_checks
from app.harnesses import get_preset
from app.runconfig import HARNESSES
from support import REDIS_BASE

REDIS_DB = 15
pytestmark = pytest.mark.slow


def test_all_harnesses_through_real_pipeline(redis_db, tmp_path):
    names = [n for n in HARNESSES if get_preset(n).is_installed()]
    if not names:
        pytest.skip("no harness CLI installed: `python -m app harness install all`")
    missing = sorted(set(HARNESSES) - set(names))
    reports = run_pipeline_checks(names, redis_url=f"{REDIS_BASE}/{REDIS_DB}", timeout_s=420,
                                  workdir=tmp_path)
    assert [r.harness for r in reports] == names
    for r in reports:
        assert r.run_status == "completed" and r.episode_status == "completed", (r.harness, r.error)
        assert r.exit_status == "exit 0", r.harness
        assert r.completions_with_ids >= 1 and r.apis == [get_preset(r.harness).api], r.as_dict()
        assert r.edit_in_patch, r.harness
        assert not r.credentials_stored
        stats = r.merge_stats["prefix_merging"]  # built by the pipeline from the captured ids
        assert stats["accepted"] == r.completions and stats["chains"] >= 1
        assert r.ok, r.problems
    if missing:
        pytest.skip(f"passed for {names}; not installed here: {missing}")


def test_cli_rejects_unknown_harness():
    proc = subprocess.run([sys.executable, "-m", "app", "harness", "check", "nope", "--pipeline"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "unknown harness 'nope'" in proc.stderr and "mini-swe-agent" in proc.stderr
