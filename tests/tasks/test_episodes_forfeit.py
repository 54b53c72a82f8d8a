"""No escape from a zero reward: an episode that its own agent's actions ended trains with reward 0.

Real parts: the real mini-swe-agent CLI in a real LocalRuntime under bubblewrap (prepared by
`RealStages.prepare`), the real gateway (gunicorn) recording every call in SQLite, the scripted
engine answering with the bash tool calls each test scripts (an embedded model's replies would
not be predictable), and the episode stages as the workers run them (`app.control.episodes.rollout`
then `.grade`, real Redis).  Before, each of these episodes ended `failed` and was left out of its
GRPO group (or, for the link, graded resolved): a policy could escape its negative advantage by
breaking its own episode.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sqlalchemy import select

from app import config
from app.config import ROOT
from app.control import episodes
from app.control.real_stages import RealStages
from app.db import session_scope
from app.harnesses import get_preset
from app.harnesses.mini_swe_agent import SUBMIT
from app.runconfig import RunConfig
from app.runtimes import bwrap_available
from app.tables import Episode, Group, Run, TaskInstance, Trajectory
from app.tasksets import load_task_set
from support import free_port
from support.gateway import start_gateway, stop, wait_http

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap (Debian package `bubblewrap`) is not installed/usable here")

REDIS_DB = 10
INSTANCE = "synthetic__inflection-1"
FIX = "sed -i 's/in (11, 12):/in (11, 12, 13):/' inflection/__init__.py"  # this instance's gold change


@pytest.fixture
def stack(database, redis_db, tmp_path, monkeypatch):
    """Gateway + scripted engine; `run(commands)` makes a train episode whose agent runs `commands`
    (one bash tool call each, then submit) through the rollout and grade stages."""
    if not get_preset("mini-swe-agent").is_installed():
        pytest.fail("mini-swe-agent is not installed: run `make ci-deps` (or `python -m app harness install mini-swe-agent`)")
    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("TURNSTILE_CACHE_DIR", str(ROOT / "var" / "cache"))
    monkeypatch.setenv("TURNSTILE_SANDBOX_DISK_MB", "64")
    procs = []

    def run(commands: list[str]) -> Episode:
        script = tmp_path / "script.json"
        replies = [{"text": "Running.", "tool_calls": [{"name": "bash", "arguments": {"command": c}}]} for c in commands]
        replies.append({"text": "Submitting.", "tool_calls": [{"name": "bash", "arguments": {"command": SUBMIT}}]})
        script.write_text(json.dumps({"default": replies}))
        engine_port, gw_port = free_port(), free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "app.conformance.scripted", "--port", str(engine_port),
                                       "--script", str(script)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        procs.append(start_gateway(gw_port, database, f"http://127.0.0.1:{engine_port}", tmp_path / "gateway.log"))
        monkeypatch.setenv("TURNSTILE_GATEWAY_URL", f"http://127.0.0.1:{gw_port}")
        config.reset_settings()
        wait_http(f"http://127.0.0.1:{engine_port}/health", timeout=120)  # a loaded CI box starts slowly
        wait_http(f"http://127.0.0.1:{gw_port}/health", timeout=120)
        record = load_task_set("synthetic").get(INSTANCE)
        cfg = RunConfig.model_validate({"kind": "train", "harness": "mini-swe-agent", "task_set": "synthetic",
                                        "group_size": 2, "tasks_per_step": 1, "steps": 1,
                                        "model": {"name": "scripted-tiny"}, "budget": {"max_turns": 6},
                                        "timeouts": {"agent_s": 180, "grade_s": 300}})
        with session_scope() as s:
            inst = TaskInstance(task_set="synthetic", instance_id=INSTANCE, repo=record.repo,
                                record=record.model_dump(mode="json"))
            # No instance list in the summary: the scheduler's ticks plan nothing around the stages.
            runrow = Run(kind="train", config=cfg.model_dump(mode="json"), status="running", summary={})
            s.add_all([inst, runrow])
            s.flush()
            s.add(Group(run_id=runrow.id, group_index=0, instance_id=inst.id, policy_version=0))
            ep = Episode(run_id=runrow.id, instance_id=inst.id, group_index=0, sample_index=0, status="running")
            s.add(ep)
            s.flush()
            episode_id = ep.id
        runtime = RealStages().prepare(record.model_dump(mode="json"), episode_id, cfg)
        with session_scope() as s:
            s.get(Episode, episode_id).runtime = runtime
        plan = episodes.rollout(episode_id)
        if plan.grade:
            episodes.grade(episode_id)
        with session_scope() as s:
            ep = s.get(Episode, episode_id)
            s.expunge(ep)
            return ep

    yield run
    stop(procs)
    config.reset_settings()


def _trajectories(episode_id: int) -> list[Trajectory]:
    with session_scope() as s:
        return list(s.scalars(select(Trajectory).where(Trajectory.episode_id == episode_id)))


def test_a_sandbox_cap_hit_after_sampling_trains_with_reward_0(stack):
    ep = stack(["head -c 200M /dev/zero > big.bin; sleep 6; echo wrote"])
    assert (ep.status, ep.reward, ep.resolved) == ("completed", 0.0, False), (ep.status, ep.error)
    forfeit = ep.grading_report["forfeit"]
    assert forfeit["cause"] == "sandbox_limit" and "disk limit reached" in forfeit["reason"], forfeit
    assert ep.error is None and _trajectories(ep.id), "a forfeited episode trains in its group"


def test_a_link_to_a_host_file_is_refused_and_scores_0(stack):
    target = "/usr/lib/google-cloud-sdk/platform/bq/third_party/inflection/__init__.py"
    ep = stack([f"rm inflection/__init__.py && ln -s {target} inflection/__init__.py && ls -l inflection"])
    assert (ep.status, ep.reward) == ("completed", 0.0), (ep.status, ep.error, ep.grading_report)
    forfeit = ep.grading_report["forfeit"]
    assert forfeit["cause"] == "patch_refused" and "inflection/__init__.py -> /usr/lib" in forfeit["reason"]
    assert _trajectories(ep.id)


def test_agent_written_git_attributes_no_longer_break_extraction(stack):
    """A `.gitattributes` with a working-tree encoding made `git add` raise in the rollout (the
    episode failed); now the patch is extracted as written and graded on its merits."""
    ep = stack([f"printf '*.txt working-tree-encoding=UTF-16\\n' > .gitattributes && echo note > note.txt && {FIX}"])
    assert ep.status == "completed" and "forfeit" not in (ep.grading_report or {}), (ep.status, ep.error)
    assert "+*.txt working-tree-encoding=UTF-16" in ep.patch and "in (11, 12, 13):" in ep.patch
    assert (ep.reward, ep.resolved) == (1.0, True), ep.grading_report
