"""Every instance of both task sets: built from its PyPI sdist, graded with no patch and with the gold patch.

The same code path as an episode's grade: `app.grading.grade` prepares a fresh
`LocalRuntime` (cached sdist, base and venv; new workspace), applies the patch,
runs the eval script under bubblewrap and grades the log with swebench.
Expected: no patch → resolved=False (every FAIL_TO_PASS test fails, every
PASS_TO_PASS test passes); gold `patch` → resolved=True.

Setup is cached (sdists by hash, bases per instance, venvs per environment; the
cache is `var/cache` of the checkout, so only the first run pays the ~10 venv
builds) and independent grades run two at a time (2 cores), longest first.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.config import ROOT, Settings
from app.grading import grade
from app.runtimes import bwrap_available
from app.tasksets import NAMED_SETS, load_task_set

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not bwrap_available(), reason="bubblewrap (Debian package `bubblewrap`) is not installed/usable here"),
]

REAL_PATH = NAMED_SETS["swebench-real"]
SYNTHETIC = load_task_set("synthetic").instances
REAL = load_task_set("swebench-real").instances if REAL_PATH.exists() else []
SLOW_FIRST = ("more-itertools", "humanize", "flask")  # longest evals start first


def _params():
    out = [pytest.param("synthetic", r.instance_id, id=r.instance_id) for r in SYNTHETIC]
    if REAL:
        out += [pytest.param("swebench-real", r.instance_id, id=r.instance_id) for r in REAL]
    else:
        out.append(pytest.param("swebench-real", None, id="swebench-real",
                                marks=pytest.mark.skip(reason=f"{REAL_PATH} does not exist on this machine")))
    return out


@pytest.fixture(scope="module")
def all_grades(tmp_path_factory):
    """{instance_id: (no-patch GradeResult, gold GradeResult)}, graded two at a time."""
    var = tmp_path_factory.mktemp("var")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TURNSTILE_CACHE_DIR", str(ROOT / "var" / "cache"))
        settings = Settings.from_env().model_copy(update={"var_dir": var})
        records = sorted(SYNTHETIC + REAL, key=lambda r: not any(k in r.instance_id for k in SLOW_FIRST))
        jobs = [(r, p) for r in records for p in ("", r.patch)]
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {(r.instance_id, bool(p)): pool.submit(grade, r, p, settings=settings, use_cache=False)
                       for r, p in jobs}
            results = {key: f.result() for key, f in futures.items()}
        wall = time.monotonic() - t0
    print(f"\ngraded {len(jobs)} (instance, patch) pairs in {wall:.1f} s wall")
    for (iid, gold), res in sorted(results.items()):
        t = res.report["timings"]
        print(f"  {iid:42s} {'gold' if gold else 'none'}: prepare {t['prepare_s']:.1f} s "
              f"(runtime {res.report['runtime_timings']}), eval {t['eval_s']:.1f} s")
    return {iid: (results[(iid, False)], results[(iid, True)]) for iid, _ in results}


@pytest.mark.parametrize(("task_set", "instance_id"), _params())
def test_instance_grades_unresolved_without_patch_and_resolved_with_gold(all_grades, task_set, instance_id):
    record = load_task_set(task_set).get(instance_id)
    none, gold = all_grades[instance_id]

    assert none.report["confined"] and gold.report["confined"]
    assert (none.resolved, none.reward) == (False, 0.0), none.report
    status = none.report["tests_status"]
    assert sorted(status["FAIL_TO_PASS"]["failure"]) == sorted(record.FAIL_TO_PASS)
    assert sorted(status["PASS_TO_PASS"]["success"]) == sorted(record.PASS_TO_PASS)

    assert gold.report["apply"] == {"applied": True, "method": "git apply --verbose -p1", "reason": None}
    assert (gold.resolved, gold.reward) == (True, 1.0), gold.report
    status = gold.report["tests_status"]
    assert sorted(status["FAIL_TO_PASS"]["success"]) == sorted(record.FAIL_TO_PASS)
    assert status["PASS_TO_PASS"]["failure"] == []
