"""Which comparisons are refused, through the real API (under gunicorn, on the seeded SQL) and the
real CLI (`python -m app compare` / `diff` against it): each reason a 400 naming it and exit 2,
each forced comparison a warning per mismatch, "held-out" only for disjoint instances."""
from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from api.dashboard.compare_seed import CASES, REFUSALS, seed_pairs
from app.api.dashboard.compare import REPLICATES
from app.control.heldout import samples as instance_samples
from app.db import session_scope
from app.stats import compare_samples
from support import AUTH, ROOT


@pytest.fixture(scope="module")
def pairs(site):
    return seed_pairs()


def _get(site, path: str, **params) -> httpx.Response:
    return httpx.get(site["url"] + path, params=params, headers=AUTH, timeout=60)


def _cli(site, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TURNSTILE_API_URL": site["url"]}
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_api_compares_two_completed_evals_of_held_out_instances(site, pairs):
    a, b = pairs["before"], pairs["after"]
    resp = _get(site, "/api/compare", a=a, b=b)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["warnings"] == [] and body["held_out"] is True and body["forced"] is False
    with session_scope() as s:
        expected = compare_samples(instance_samples(s, a), instance_samples(s, b), replicates=REPLICATES, seed=0)
    assert body["difference"] == expected.to_dict()  # JSON round-trips Python floats exactly
    assert [r["id"] for r in body["runs"]] == [a, b]


def test_a_before_run_over_more_instances_compares_on_the_after_runs_instances(site, pairs):
    """`turnstile learn`'s shape: the before eval sampled the held-out and more; the after one the held-out."""
    body = _get(site, "/api/compare", a=pairs["wider_before"], b=pairs["after"]).json()
    assert body["held_out"] is True and body["difference"]["instances"] == 3
    assert body["warnings"] == [f"the runs have graded results for different instances (1 only in "
                                f"#{pairs['wider_before']}, 0 only in #{pairs['after']}): the overall and the "
                                f"difference cover the 3 shared instances only"]


@pytest.mark.parametrize("case, reason", REFUSALS)
def test_api_refuses_with_the_reason_and_compares_when_forced(site, pairs, case, reason):
    a, b = (pairs[k] for k in CASES[case])
    resp = _get(site, "/api/compare", a=a, b=b)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["message"].startswith(f"runs #{a} and #{b} cannot be compared: ") and reason in err["message"]
    assert err["message"].endswith("add force=1 to compare them anyway")
    assert any(reason in d["message"] for d in err["details"])
    forced = _get(site, "/api/compare", a=a, b=b, force=1)
    assert forced.status_code == 200, forced.text
    body = forced.json()
    assert body["forced"] is True and body["held_out"] is False
    assert [d["message"] for d in err["details"]] == body["warnings"][:len(err["details"])]


def test_api_names_a_missing_run_and_a_bad_flag(site, pairs):
    resp = _get(site, "/api/compare", a=pairs["before"], b=2**31 - 1)
    assert resp.status_code == 404 and resp.json()["error"]["message"] == f"run {2**31 - 1} not found"
    resp = _get(site, "/api/compare", a=pairs["before"], b=pairs["after"], force="perhaps")
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "force"
    resp = _get(site, "/api/compare", a="x", b=pairs["after"])
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "a"


def test_cli_refuses_with_exit_2_and_compares_when_forced(site, pairs):
    a, b = pairs["train"], pairs["after"]
    refused = _cli(site, "compare", str(a), str(b), "--replicates", "200")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"runs #{a} and #{b} cannot be compared" in refused.stderr and "is a train run, not an eval" in refused.stderr
    assert "add --force" in refused.stderr and "pass@1" not in refused.stdout
    unpaired = _cli(site, "compare", str(a), str(b), "--force")  # forced, but no instance in common
    assert unpaired.returncode == 2 and "share no graded instance" in unpaired.stderr
    a = pairs["running_eval"]
    forced = _cli(site, "compare", str(a), str(b), "--replicates", "200", "--force")
    assert forced.returncode == 0, forced.stderr
    out = " ".join(forced.stdout.split())  # rich wraps long lines
    assert f"warning: run #{a} is running: its results are partial" in out
    assert "held-out" not in out and f"pass@1: run {a} (before) vs run {b} (after)" in out


def test_cli_writes_held_out_only_for_instances_the_train_run_never_saw(site, pairs):
    held = _cli(site, "compare", str(pairs["before"]), str(pairs["after"]), "--replicates", "200")
    assert held.returncode == 0, held.stderr
    assert "held-out pass@1" in held.stdout and "warning" not in held.stdout
    seen = _cli(site, "compare", str(pairs["train_set_before"]), str(pairs["train_set_after"]), "--replicates", "200",
                "--force")
    assert seen.returncode == 0, seen.stderr
    assert "held-out pass@1" not in seen.stdout and "not held-out" in " ".join(seen.stdout.split())


def test_config_diff_through_the_api_and_the_cli(site, pairs):
    a, b = pairs["before"], pairs["other_eval"]
    body = _get(site, f"/api/runs/{a}/diff/{b}").json()
    with session_scope() as s:
        from app.tables import Run

        ca, cb = s.get(Run, a).config, s.get(Run, b).config
    assert body["diff"] == [{"key": "instances", "change": "changed", "a": ca["instances"], "b": cb["instances"]}]
    train = _get(site, f"/api/runs/{pairs['train']}/diff/{b}").json()["diff"]
    assert {"key": "kind", "change": "changed", "a": "train", "b": "eval"} in train
    assert _get(site, f"/api/runs/{a}/diff/{a}").json()["diff"] == []
    assert _get(site, f"/api/runs/{a}/diff/{2**31 - 1}").status_code == 404
    out = _cli(site, "diff", str(a), str(b))
    assert out.returncode == 0 and "instances" in out.stdout and "1 keys differ" in out.stdout, out.stderr
    assert "same config" in _cli(site, "diff", str(a), str(a)).stdout
    missing = _cli(site, "diff", str(a), str(2**31 - 1))
    assert missing.returncode == 2 and f"run {2**31 - 1} not found" in missing.stderr


pytestmark = pytest.mark.timeout(600)
