"""A mini-swe-agent train episode inside a task's container image, through the gateway.

Real parts: the fixture image (SWE-bench layout, scripts/build_fixture_image.sh, standing in for
a published `swebench/sweb.eval.x86_64.psf_1776_requests-*` image) served by a real
`docker-registry` on loopback; the episode's prepare and rollout stages as the workers run them
(`RealStages.prepare` pulls with skopeo and unpacks with umoci; `RealStages.rollout` runs the
real mini-swe-agent CLI, mounted read-only from the host, under bubblewrap in the image with only
the gateway reachable); the real gateway (gunicorn) recording every call in SQL.  The model is the
scripted engine answering mini-swe-agent's check script (five bash tool calls, the last one
writing hello.txt, then submit), so the test can check that the agent's tool calls really ran
in the image's /testbed; an embedded model's replies would not be predictable.
"""
from __future__ import annotations

import pytest

from app import config
from app.control.real_stages import RealStages
from app.control.stages import Claim
from app.harnesses import get_preset
from app.harnesses.base import CHECK_CONTENT, CHECK_FILE
from app.runconfig import RunConfig
from app.runtimes import attach_runtime
from app.runtimes.oci import OciRuntime
from support import free_port
from support.gateway import completions, make_episode, start_gateway, stop, wait_http
from support.registry import Registry, fixture_layout

pytestmark = pytest.mark.slow


def test_mini_swe_agent_episode_runs_inside_the_image_through_the_gateway(database, tmp_path, monkeypatch):
    import subprocess
    import sys

    from app.config import ROOT

    preset = get_preset("mini-swe-agent")
    if not preset.is_installed():
        pytest.fail("mini-swe-agent is not installed: run `make ci-deps` (or `python -m app harness install mini-swe-agent`)")
    engine_port, gw_port = free_port(), free_port()
    engine = subprocess.Popen([sys.executable, "-m", "app.conformance.scripted.check", "--harness", "mini-swe-agent",
                               "--port", str(engine_port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gateway = start_gateway(gw_port, database, f"http://127.0.0.1:{engine_port}", tmp_path / "gateway.log")
    monkeypatch.setenv("TURNSTILE_GATEWAY_URL", f"http://127.0.0.1:{gw_port}")
    config.reset_settings()
    try:
        wait_http(f"http://127.0.0.1:{engine_port}/health")
        wait_http(f"http://127.0.0.1:{gw_port}/health")
        with Registry(tmp_path / "registry") as reg:
            image = reg.push(f"oci:{fixture_layout()}:fixture", "swe/requests:2.27")
            record = {"instance_id": "psf__requests-fixture", "repo": "psf/requests", "version": "2.27",
                      "patch": "x", "problem_statement": "Create hello.txt as asked.",
                      "FAIL_TO_PASS": ["tests/test_utils.py::test_x"], "PASS_TO_PASS": [], "base_commit": "abcdef1",
                      "test_cmd": "pytest", "image": image}
            cfg = RunConfig.model_validate({"kind": "train", "harness": "mini-swe-agent", "group_size": 2,
                                            "tasks_per_step": 1, "steps": 1, "budget": {"max_turns": 8},
                                            "timeouts": {"agent_s": 240}})
            assert cfg.runtime == "auto"
            episode_id, token = make_episode()
            stages = RealStages()
            state = stages.prepare(record, episode_id, cfg)  # the prepare stage pulls and unpacks
            assert state["kind"] == "oci" and state["digest"].startswith("sha256:")
            try:
                outcome = stages.rollout(Claim(episode_id, 1, 1, cfg, record, state, 0), token, lambda: False)
                log = open(outcome.log_path).read()
            finally:
                stages.release(state)
    finally:
        stop([gateway, engine])
        (tmp_path / "gateway.log").exists() and print((tmp_path / "gateway.log").read_text()[-3000:])
    assert outcome.failure is None and outcome.exit_status == "exit 0", log[-3000:]
    assert f"+{CHECK_CONTENT}" in outcome.patch and f"b/{CHECK_FILE}" in outcome.patch
    calls = completions(episode_id)
    assert len(calls) >= 5 and {c.api for c in calls} == {"chat"}
    assert all(c.prompt_ids and c.sampled_ids and len(c.sampled_ids) == len(c.logprobs) for c in calls)
    # The agent's first commands ran in the image's repository: `git status` saw requests' tree.
    messages = (calls[-1].normalized_request or {}).get("messages", [])
    later = " ".join(str(m.get("content")) for m in messages[2:] if isinstance(m, dict))
    assert "setup.py" in later and "requests" in later, [m.get("role") for m in messages]
    assert not attach_runtime(state).root.exists()  # released
    # Grading runs in a fresh runtime of the same image: the patch applies there.
    with OciRuntime.prepare(record, purpose="grade") as grade:
        assert grade.run("git apply -", stdin=outcome.patch).ok
        assert grade.run(f"cat {CHECK_FILE}").stdout.strip() == CHECK_CONTENT
