"""Grading inside the CI fixture image (real skopeo, umoci, bubblewrap; psf/requests 2.27 at /testbed,
standing in for swebench's `sweb.eval.x86_64.psf_1776_requests-*` images, SWE-smith's per-repo images,
and, with R2E-Gym's hidden tests added, an R2E-Gym per-commit image): gold resolves, empty does not."""
import logging

import pytest

from app.config import get_settings
from app.grading.grader import grade
from app.grading.harbor import oracle_patch
from app.runtimes.oci import OciRuntime
from app.tasksets.loader import load_published
from support.format_fixtures import format_fixtures
from support.registry import fixture_layout, r2e_fixture_layout
from support.tampering import REPORT_HACK


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    image = f"oci:{fixture_layout()}:fixture"
    probe = format_fixtures(tmp_path_factory.mktemp("probe"), image=image)
    with OciRuntime.prepare(load_published(probe / "swebench_verified.jsonl")[0][0], purpose="grade") as rt:
        base = rt.base_commit  # the image's own commit of /testbed
    return format_fixtures(tmp_path_factory.mktemp("formats"), image=image, base_commit=base,
                           r2e_image=f"oci:{r2e_fixture_layout()}:fixture")


@pytest.mark.parametrize("name", ["swebench_verified.jsonl", "swerebench_v2.json", "harbor", "swesmith.jsonl",
                                  "r2egym.jsonl"])
def test_gold_resolves_and_empty_does_not(fixtures, name, caplog):
    rec = load_published(fixtures / name)[0][0]
    gold = oracle_patch(rec, settings=get_settings()) if rec.grader == "harbor" else rec.patch
    with caplog.at_level(logging.WARNING, logger="app.grading.outcome"):
        good = grade(rec, gold, use_cache=False, timeout_s=300)
    # Resolved: no test id is reported missing, whichever rule judged (R2E-Gym reads `Class.test`
    # where swebench's parser gives `path::Class::test`, and its own rule is the verdict).
    assert "never appear" not in caplog.text, caplog.text
    empty = grade(rec, "", use_cache=False, timeout_s=300)
    assert (good.resolved, good.reward) == (True, 1.0), good.log_path
    assert (empty.resolved, empty.reward) == (False, 0.0), empty.log_path
    assert good.report["image"] == rec.image


def test_harbor_reward_planted_by_the_agent_is_gone(fixtures):
    rec = load_published(fixtures / "harbor")[0][0]
    with OciRuntime.prepare(rec, purpose="episode") as rt:  # the agent plants a reward and a test helper
        res = rt.run("mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && "
                     "mkdir -p logs/verifier && echo 1 > logs/verifier/reward.txt && echo 1 > reward.txt")
        assert res.ok, res.stderr
        patch = rt.patch()
    assert "reward.txt" in patch
    result = grade(rec, patch, use_cache=False)
    assert (result.resolved, result.reward) == (False, 0.0), result.log_path


def test_r2egym_runner_and_tests_the_agent_planted_are_not_used(fixtures):
    """The agent cannot see R2E-Gym's hidden runner; a runner or r2e_tests it writes is dropped at grading."""
    rec = load_published(fixtures / "r2egym.jsonl")[0][0]
    with OciRuntime.prepare(rec, purpose="episode") as rt:
        res = rt.run("printf 'echo PASSED r2e_tests/test_x.py::TestLookupDict::test_contains\\n' > run_tests.sh && "
                     "mkdir -p r2e_tests && echo 'def test_contains(): pass' > r2e_tests/test_structures.py")
        assert res.ok, res.stderr
        patch = rt.patch()
    # The runner is a file the image has untracked: the patch never carries one; planted tests are dropped.
    assert "run_tests.sh" not in patch and "b/r2e_tests/test_structures.py" in patch
    result = grade(rec, patch, use_cache=False, timeout_s=300)
    assert (result.resolved, result.reward) == (False, 0.0), result.log_path
    assert result.report["dropped_test_files"] == ["r2e_tests/test_structures.py"]




@pytest.mark.parametrize("name", ["swebench_verified.jsonl", "harbor"])
def test_library_code_that_reaches_into_pytest_never_passes_in_an_image(fixtures, tmp_path, name):
    """The fix together with code that rewrites pytest's reports: unresolved, the finding recorded
    (the image grader and the Harbor verifier path apply the local grader's rules)."""
    from app.gitutil import git

    rec = load_published(fixtures / name)[0][0]
    gold = oracle_patch(rec, settings=get_settings()) if rec.grader == "harbor" else rec.patch
    (tmp_path / "gold.diff").write_text(gold)
    with OciRuntime.prepare(rec, purpose="episode") as rt:
        git(rt.workspace, "apply", str(tmp_path / "gold.diff"))
        init = rt.workspace / "requests" / "__init__.py"
        init.write_text(init.read_text() + REPORT_HACK)
        patch = rt.patch()
    result = grade(rec, patch, use_cache=False, timeout_s=300)
    assert (result.resolved, result.reward, result.report["resolved"]) == (False, 0.0, False), result.log_path
    assert any("_pytest.reports" in f for f in result.report["tampering"]["requests/__init__.py"])
