"""A train run over a SWE-bench Verified row served by its container image, through the whole pipeline.

Real parts: the fixture image (`scripts/build_fixture_image.sh`: psf/requests 2.27.1 at /testbed and
a `testbed` env activated as swebench's conda env is, standing in for a published
`swebench/sweb.eval.x86_64.psf_1776_requests-*` image) pushed to a real `docker-registry` on
loopback; the row as published (tests/fixtures/formats/swebench_verified.jsonl: no eval script,
no test command, so the loader builds them with swebench's own spec table); the REST API, the
gateway, the embedded CPU engine on SmolLM2-135M and Celery workers per queue (as
tests/e2e/test_pipeline.py starts them); skopeo pulling from the registry, umoci unpacking,
mini-swe-agent mounted read-only from the host and run under bubblewrap inside the image, and
grading by swebench's eval script in a fresh runtime of the same image.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from app.config import ROOT
from app.db import session_scope
from app.harnesses import get_preset
from app.runtimes.oci import OciRuntime
from app.tables import Completion, Episode, Group, Run, TrainingStep
from app.tasksets.loader import load_published
from app.tasksets.swebench_compat import grading_module, make_test_spec
from support import wait_for
from support.format_fixtures import format_fixtures
from support.registry import Registry, fixture_layout

pytestmark = pytest.mark.slow

INSTANCE = "psf__requests-9001"
ROW_FILE = "swebench_verified.jsonl"
# swebench's name for the row's image, as a user's registry would serve it.
IMAGE_NAME = "swebench/sweb.eval.x86_64.psf_1776_requests-9001:latest"
# The smallest train run that yields a completed step: one group of two episodes, SmolLM2 with a
# short budget (as tests/e2e/test_pipeline.py runs it), the runtime chosen from the row's image.
RUN = {"kind": "train", "harness": "mini-swe-agent", "runtime": "auto", "instances": [INSTANCE],
       "model": {"name": "tiny"}, "group_size": 2, "tasks_per_step": 1, "steps": 1,
       "budget": {"max_turns": 2, "max_tokens": 24}, "timeouts": {"agent_s": 180, "grade_s": 300}}


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """The fixture image in a loopback registry under swebench's image name; yields its `docker://` reference."""
    with Registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg.push(f"oci:{fixture_layout()}:fixture", IMAGE_NAME)


def published_rows(folder: Path, image: str) -> Path:
    """The SWE-bench Verified fixture row naming `image`, with the image's own commit of /testbed
    as its base commit (the eval script checks the test files out at it); returns the row file."""
    probe = format_fixtures(folder / "probe", image=image)
    with OciRuntime.prepare(load_published(probe / ROW_FILE)[0][0], purpose="grade") as rt:  # pulled through skopeo
        base = rt.base_commit
    return format_fixtures(folder / "rows", image=image, base_commit=base) / ROW_FILE


def test_mini_swe_agent_train_run_in_the_image_graded_by_swebench_eval_script(stack, registry):
    if not get_preset("mini-swe-agent").is_installed():
        pytest.fail("mini-swe-agent is not installed: run `make ci-deps` (or `python -m app harness install mini-swe-agent`)")
    var = Path(stack.env["TURNSTILE_VAR_DIR"])
    rows = published_rows(var / "tasks", registry)  # <var_dir>/tasks: a folder runs may name
    record = load_published(rows)[0][0]
    assert record.image == registry and record.source_kind == "image" and record.grader == "swebench"
    resp = stack.api.post("/api/runs", json={**RUN, "task_set": str(rows)})
    assert resp.status_code == 202, resp.text
    run_id = resp.json()["id"]

    def done():
        run = stack.api.get(f"/api/runs/{run_id}").json()
        return run if run["status"] in ("completed", "failed", "cancelled") else None

    run = wait_for(done, 420, interval=1, what=lambda: f"run {run_id} to finish\n{stack.logs()}")
    assert run["status"] == "completed", (run["error"], stack.logs())

    spec = make_test_spec(record)
    with session_scope() as s:
        episodes = s.scalars(select(Episode).where(Episode.run_id == run_id)).all()
        assert len(episodes) == 2 and {e.status for e in episodes} == {"completed"}, \
            [(e.status, e.error) for e in episodes]
        evaluated = set()
        for ep in episodes:
            # Prepared as an image runtime: the oci state the prepare stage stored on the episode.
            assert ep.runtime["kind"] == "oci" and ep.runtime["image"] == registry, ep.runtime
            assert ep.runtime["digest"].startswith("sha256:") and ep.runtime["repo_dir"] == "/testbed"
            harness_log = var / "runs" / str(run_id) / "episodes" / str(ep.id) / f"harness-attempt{ep.attempts}.log"
            assert "confined=True" in harness_log.read_text()
            comps = s.scalars(select(Completion).where(Completion.episode_id == ep.id)).all()
            assert comps, f"episode {ep.id} recorded no completion"
            for c in comps:  # every model call went through the gateway and was captured with its tokens
                assert c.api == "chat" and c.engine_id and c.policy_version == 0 and not c.partial
                assert c.prompt_ids and c.sampled_ids and len(c.sampled_ids) == len(c.logprobs)
                assert all(lp <= 0.0 for lp in c.logprobs)
            # Graded by swebench's eval script in a fresh runtime of the same image.
            report = ep.grading_report
            assert report["image"] == registry and report["grader"] == "swebench" and report["confined"]
            assert report["image_digest"] == ep.runtime["digest"]
            assert ep.reward == (1.0 if report["resolved"] else 0.0) and ep.resolved == report["resolved"]
            log_path = Path(report["log_path"])
            assert log_path.is_relative_to(var / "grading" / "logs"), log_path
            if report["cached"]:  # the same patch graded a moment ago: the cache names that grade's log
                assert log_path.is_file()
                continue
            text = log_path.read_text()
            if not report["apply"]["applied"]:  # the model's patch did not apply: no tests ran, reward 0
                assert ep.reward == 0.0 and ">>>>> Patch Apply Failed" in text, text[-2000:]
                continue
            # swebench's own eval script ran in the image's testbed env ...
            assert "conda activate testbed" in text and "cd /testbed" in text
            assert f"git checkout {record.base_commit} tests/test_structures.py" in text
            assert ">>>>> Start Test Output" in text and ">>>>> End Test Output" in text
            assert "rootdir: /testbed" in text  # pytest ran on the image's repository copy
            evaluated.add(log_path)
            # ... and the report's FAIL_TO_PASS / PASS_TO_PASS are what swebench's parser reads in that log.
            status, ran = grading_module().get_logs_eval(spec, str(log_path))
            assert ran, text[-2000:]
            tests = report["tests_status"]
            for group_name, ids in (("FAIL_TO_PASS", record.FAIL_TO_PASS), ("PASS_TO_PASS", record.PASS_TO_PASS)):
                passed = sorted(t for t in ids if status.get(t) in ("PASSED", "XFAIL"))
                assert sorted(tests[group_name]["success"]) == passed, (group_name, tests, status)
                assert sorted(tests[group_name]["failure"]) == sorted(set(ids) - set(passed))
                for test_id in ids:
                    assert re.search(rf"^(PASSED|FAILED|ERROR) {re.escape(test_id)}\b", text, re.M), test_id
        # At least one grade ran the eval script here (an empty patch applies as "empty patch"; a
        # patch of the episode's own tree applies to the same image).
        assert evaluated, [(e.id, e.grading_report["apply"]) for e in episodes]
        outcomes = [(len(e.patch or ""), e.grading_report["cached"], e.grading_report["apply"]["method"])
                    for e in episodes]

        group = s.scalars(select(Group).where(Group.run_id == run_id)).one()
        step = s.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id)).one()
        assert step.status == "completed" and step.policy_version == 1 == s.get(Run, run_id).policy_version
        assert sorted(step.episode_ids) == sorted(e.id for e in episodes)
        rewards = sorted(e.reward for e in episodes)
        # Dynamic sampling is off, so a uniform group (SmolLM2 with 24 tokens rarely solves a real
        # SWE-bench row) is trained anyway with zero advantage: the step records what it got.
        assert group.status not in ("filtered", "rejected"), group.status
        assert step.metrics["tokens_trained"] > 0, step.metrics
    assert run["summary"]["steps"][0]["episodes"] == 2
    print(f"run {run_id}: rewards {rewards}, (patch chars, cached, applied by) {outcomes}, group {group.status}, "
          f"step metrics {json.dumps({k: step.metrics.get(k) for k in ('tokens_trained', 'logprob_gap_max_abs')})}")


def test_tasks_validate_gold_resolves_and_empty_does_not_in_the_served_image(registry, tmp_path):
    """`python -m app tasks validate` (the real CLI) on the row naming the registry's image: the gold
    patch resolves and the empty patch does not, each graded by swebench's eval script in the image."""
    rows = published_rows(tmp_path, registry)
    proc = subprocess.run([sys.executable, "-m", "app", "tasks", "validate", str(rows), "--jobs", "2",
                           "--timeout", "300"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "formats: swebench 1" in out, out
    assert re.search(rf"^ok   {INSTANCE}: gold resolves, empty does not", proc.stdout, re.M), out
    assert "1 of 1 instance(s) sound; cannot be solved: 0; solved by an empty patch: 0; not graded: 0" in out
