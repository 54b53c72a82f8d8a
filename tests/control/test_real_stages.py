"""Harness failures are not reward 0: a harness that made no usable model call fails its episode
with the cause and its log's tail, a group's worth of them stops the run with one clear error,
they are counted in the step and run metrics, and a harness whose measured minimum prompt does
not fit the model's context is refused at creation naming both numbers.

Real SQL and Redis; the end-to-end versions (real harness, gateway, engine) are in tests/e2e.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select

from app import create_app
from app.control import scheduler
from app.control.preflight import EMBEDDED_CONTEXT, check_prompt_fits
from app.control.real_stages import LOG_TAIL_CHARS, harness_failure
from app.control.stages import HARNESS_FAILED, harness_failure_cause
from app.control.summary import harness_never_worked, scheduling_metrics, summarize_run
from app.db import session_scope
from app.harnesses import PRESETS, get_preset
from app.tables import Episode, Group, Run, TaskInstance, utcnow
from app.runconfig import RunConfig
from support import api_client

REDIS_DB = 10
LOG = Path("/var/runs/1/episodes/1/harness-attempt1.log")


@pytest.fixture
def client(database, redis_db):
    return api_client(create_app({"TESTING": True}))


# --- the cause, named --------------------------------------------------------------


@pytest.mark.parametrize("exit_code, timed_out, log, words", [
    (124, True, "starting\n", "killed at its 3 s time limit (timeouts.agent_s) before any model call was answered"),
    (1, False, "Error: ran out of room in the model's context window", "exited 1: its first prompt did not fit"),
    (1, False, "This model's maximum context length is 8192 tokens. However", "did not fit the model's context window"),
    (0, False, "prompt is too long: 9185 tokens > 8192 maximum", "exited 0: its first prompt did not fit"),
    (137, False, "Killed", "crashed (exit 137, signal 9) before any usable model call"),
    (2, False, "usage: cli [-h]", "exited 2 without a usable model call"),
    (0, False, "nothing to do", "exited 0 without making a model call"),
])
def test_harness_failure_names_its_cause_and_keeps_the_log_tail(exit_code, timed_out, log, words):
    text = "x" * 5000 + "\n" + log
    error = harness_failure("codex", exit_code, timed_out, 3, text, LOG)
    cause = harness_failure_cause(error)
    assert error.startswith(HARNESS_FAILED) and cause.startswith("codex ") and words in cause
    assert "\n" not in cause
    assert error.endswith(log) and str(LOG) in error  # the tail of the log, and where the whole log is
    assert len(error) < len(HARNESS_FAILED) + len(cause) + LOG_TAIL_CHARS + 200 < 4000  # fits the error column
    assert harness_failure_cause("prepare failed: RuntimeSetupError: no venv") is None


# --- the run stops with one clear error --------------------------------------------


def _run(s, group_size: int = 2, harness: str = "mini-swe-agent") -> Run:
    cfg = RunConfig.model_validate({"kind": "train", "harness": harness, "group_size": group_size,
                                    "tasks_per_step": 1, "steps": 2})
    n = s.scalar(select(func.count()).select_from(Run))
    inst = TaskInstance(task_set="synthetic", instance_id=f"inst-{n}", repo="local/inst", record={})
    run = Run(kind="train", config=cfg.model_dump(mode="json"), status="running")
    s.add_all([inst, run])
    s.flush()
    run.summary = {"instance_ids": [inst.id]}
    s.add(Group(run_id=run.id, group_index=0, instance_id=inst.id, policy_version=0))
    return run


def _episode(s, run: Run, k: int, status: str, error: str | None = None, reward: float | None = None) -> Episode:
    ep = Episode(run_id=run.id, instance_id=run.summary["instance_ids"][0], group_index=0, sample_index=k,
                 status=status, error=error, reward=reward, policy_version=0, started_at=utcnow(),
                 rollout_finished_at=utcnow(), finished_at=utcnow() if status in ("completed", "failed") else None)
    s.add(ep)
    s.flush()
    return ep


def _overflow(k: int) -> str:
    return harness_failure("mini-swe-agent", 1, False, 600, f"attempt {k}: maximum context length is 8192 tokens", LOG)


def test_a_group_of_harness_failures_fails_the_run_with_one_clear_error(database, redis_db):
    with session_scope() as s:
        run = _run(s)
        run_id = run.id
        _episode(s, run, 0, "failed", _overflow(0))
        assert harness_never_worked(s, run_id, "mini-swe-agent", 2) is None  # one failure is not yet a group's worth
        _episode(s, run, 1, "failed", _overflow(1))
    scheduler.tick(run_id)
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run.status == "failed"
        assert run.error == ("harness mini-swe-agent failed before any usable model call in 2 of 2 finished episodes: "
                             "mini-swe-agent exited 1: its first prompt did not fit the model's context window "
                             "(the gateway answered with a context-length error)")
        assert run.summary["episodes_harness_failed"] == 2
        assert s.scalar(select(func.count()).select_from(Episode).where(
            Episode.run_id == run_id, Episode.status.not_in(("completed", "failed", "cancelled")))) == 0


def test_harness_failures_beside_a_completed_episode_do_not_stop_the_run(database, redis_db):
    with session_scope() as s:
        run = _run(s, group_size=2)
        _episode(s, run, 0, "failed", _overflow(0))
        _episode(s, run, 1, "failed", _overflow(1))
        _episode(s, run, 2, "completed", reward=0.0)
        assert harness_never_worked(s, run.id, "mini-swe-agent", 2) is None
        # Other failures (not the harness's) never count as harness failures.
        other = _run(s, group_size=2)
        _episode(s, other, 0, "failed", "prepare failed: RuntimeSetupError: no venv")
        _episode(s, other, 1, "failed", "rollout failed: RuntimeClosed: runtime gone")
        assert harness_never_worked(s, other.id, "mini-swe-agent", 2) is None


def test_harness_failures_are_counted_in_step_and_run_metrics(database, redis_db):
    with session_scope() as s:
        run = _run(s, group_size=4)
        _episode(s, run, 0, "failed", _overflow(0))
        _episode(s, run, 1, "failed", "grading failed: TimeoutError")
        _episode(s, run, 2, "completed", reward=1.0)
        _episode(s, run, 3, "completed", reward=0.0)
        metrics = scheduling_metrics(s, run.id, slots=2, lags=[0], ready_waits=[])
        summary = summarize_run(s, run.id)
    assert metrics["episodes_harness_failed"] == 1
    assert summary["episodes_harness_failed"] == 1 and summary["episodes_by_status"] == {"failed": 2, "completed": 2}
    assert summary["reward_mean"] == 0.5  # the failed episode is no reward 0 in the mean


# --- refused at creation -------------------------------------------------------------


def test_embedded_context_is_the_engines_window():
    from app.engines.embedded.engine import DEFAULT_MAX_MODEL_LEN

    assert EMBEDDED_CONTEXT == DEFAULT_MAX_MODEL_LEN


def test_harness_whose_prompt_does_not_fit_is_400_naming_both_numbers(client):
    too_big = [name for name, p in PRESETS.items() if p.min_prompt_tokens and p.min_prompt_tokens >= EMBEDDED_CONTEXT]
    assert "codex" in too_big  # Codex's first prompt alone is larger than SmolLM2's window
    for name in too_big:
        resp = client.post("/api/runs", json={"kind": "train", "harness": name, "model": {"name": "tiny"}})
        assert resp.status_code == 400, resp.get_json()
        err = resp.get_json()["error"]
        need = get_preset(name).min_prompt_tokens
        assert err["field"] == "harness"
        assert f"at least {need} tokens" in err["message"] and f"{EMBEDDED_CONTEXT}-token context" in err["message"]
        assert "mini-swe-agent (" in err["message"]  # names the harnesses that fit
    with session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Run)) == 0


def test_prompt_fit_is_skipped_where_the_context_is_unknown():
    vllm = RunConfig.model_validate({"harness": "codex", "model": {"engine": "vllm", "name": "Qwen/Qwen3-0.6B",
                                                                   "engine_urls": ["http://gpu-box:8200"]}})
    assert check_prompt_fits(vllm) is None
    assert check_prompt_fits(RunConfig.model_validate({"harness": "mini-swe-agent"})) is None
    field, message = check_prompt_fits(RunConfig.model_validate({"harness": "codex"}))
    assert field == "harness" and "model smollm2" in message
