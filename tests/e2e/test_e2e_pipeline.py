"""The whole pipeline for real at the smallest size (issue 7): REST run -> Celery workers ->
harness subprocess in its sandbox -> gateway -> engine (tiny model) -> grading of a bundled
instance -> prefix-merged GRPO step on the gpu queue -> checkpoint -> engine reload -> completed.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from app.db import session_scope
from app.harnesses import get_preset
from app.models import Completion, Episode, Run, TrainingStep, Trajectory
from app.runconfig import HARNESSES
from support import wait_for

pytestmark = pytest.mark.slow

SMALLEST = {"kind": "train", "task_set": "synthetic", "instances": ["synthetic__inflection-1"],
            "model": {"name": "tiny"}, "group_size": 2, "tasks_per_step": 1, "steps": 1,
            "budget": {"max_turns": 2, "max_tokens": 24}, "timeouts": {"agent_s": 180, "grade_s": 300}}


def _finish(stack, run_id: int, timeout: float) -> dict:
    def done():
        run = stack.api.get(f"/api/runs/{run_id}").json()
        return run if run["status"] in ("completed", "failed", "cancelled") else None

    return wait_for(done, timeout, interval=1, what=f"run {run_id} to finish\n{stack.logs()}")


def test_mini_swe_agent_train_run_end_to_end(stack):
    if not get_preset("mini-swe-agent").is_installed():
        pytest.fail("mini-swe-agent is not installed: run `make ci-deps` (or `python -m app harness install mini-swe-agent`)")
    resp = stack.api.post("/api/runs", json={**SMALLEST, "harness": "mini-swe-agent"})
    assert resp.status_code == 202, resp.text
    run = _finish(stack, resp.json()["id"], 420)
    assert run["status"] == "completed", (run["error"], stack.logs())
    run_id = run["id"]

    with session_scope() as s:
        db_run = s.get(Run, run_id)
        assert db_run.policy_version == 1
        step = s.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id)).one()
        episodes = s.scalars(select(Episode).where(Episode.run_id == run_id)).all()
        assert len(episodes) == 2 and {e.status for e in episodes} == {"completed"}
        assert sorted(step.episode_ids) == sorted(e.id for e in episodes)
        sampled_total = 0
        for ep in episodes:
            assert ep.reward in (0.0, 1.0) and ep.grading_report and ep.exit_status
            assert ep.policy_version == 0 and ep.session_token_hash is None  # session closed after rollout
            comps = s.scalars(select(Completion).where(Completion.episode_id == ep.id).order_by(Completion.seq)).all()
            assert comps, f"episode {ep.id} captured no completion"
            for c in comps:
                assert c.api == "chat" and c.engine_id and c.policy_version == 0 and not c.partial
                assert c.prompt_ids and c.sampled_ids and len(c.sampled_ids) == len(c.logprobs)
                assert all(lp <= 0.0 for lp in c.logprobs)
                sampled_total += len(c.sampled_ids) if c.rejected_reason is None else 0
            trajs = s.scalars(select(Trajectory).where(Trajectory.episode_id == ep.id)).all()
            assert trajs and {t.builder for t in trajs} == {"prefix_merging"}
            by_id = {c.id: c for c in comps}
            for t in trajs:
                assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs)
                # The trainable tokens are exactly the sampled ids of the chain's completions, never re-tokenized.
                trained = [tok for tok, m in zip(t.token_ids, t.loss_mask) if m]
                expected = [tok for cid in t.completion_ids for tok in by_id[cid].sampled_ids]
                assert trained == expected
            assert ep.merge_stats["prefix_merging"]["completions"] == len(comps)
        m = step.metrics
        assert step.status == "completed" and step.policy_version == 1
        assert m["tokens_trained"] == sampled_total > 0
        assert m["logprob_gap_max_abs"] < 1e-3, m  # trainer recomputation vs engine-recorded logprobs
        assert m["engine_sync"] == {stack.env["TURNSTILE_ENGINE_URLS"]: "ok"}
        checkpoint = Path(step.checkpoint_path)
    assert (checkpoint / "model").is_dir() and any((checkpoint / "model").glob("*.safetensors"))
    assert list((Path(stack.env["TURNSTILE_VAR_DIR"]) / "runs" / str(run_id) / "tensorboard").rglob("events.out.tfevents*"))
    engine_version = httpx.get(f"{stack.env['TURNSTILE_ENGINE_URLS']}/v1/policy_version", timeout=5).json()
    assert engine_version["policy_version"] == 1  # the engine reloaded the new weights

    lines = stack.api.get(f"/api/runs/{run_id}/export").text.splitlines()
    exported = [json.loads(line) for line in lines]
    assert len(exported) == 2 and all(e["completions"] and e["trajectories"] for e in exported)
    assert run["summary"]["steps"][0]["episodes"] == 2 and run["summary"]["completions"] >= 2


def test_other_harnesses_complete_a_train_run(stack):
    """Each other preset at the smallest size: captured, graded and trained (or cleanly overflowed)."""
    names = [n for n in HARNESSES if n != "mini-swe-agent"]
    missing = [n for n in names if not get_preset(n).is_installed()]
    if missing:
        pytest.fail(f"harness CLIs not installed: {missing}; run `make ci-deps`")
    run_ids = {}
    for name in names:
        resp = stack.api.post("/api/runs", json={**SMALLEST, "harness": name,
                                                 "scheduling": {"rollout_slots": 2}})
        assert resp.status_code == 202, resp.text
        run_ids[name] = resp.json()["id"]
    for name, run_id in run_ids.items():
        run = _finish(stack, run_id, 900)
        assert run["status"] == "completed", (name, run["error"], stack.logs())
        with session_scope() as s:
            eps = s.scalars(select(Episode).where(Episode.run_id == run_id)).all()
            assert {e.status for e in eps} == {"completed"}, name
            comps = s.scalars(select(Completion).join(Episode).where(Episode.run_id == run_id)).all()
            api = get_preset(name).api
            assert {c.api for c in comps} <= {api}, (name, [c.api for c in comps])
            for c in comps:
                assert c.sampled_ids and len(c.sampled_ids) == len(c.logprobs), (name, c.error)
            if not comps:
                # The harness's prompt did not fit the 8k context: the gateway answered with its
                # API's context-overflow error (nothing recorded for a rejected call), the harness
                # said so and exited, and the episode was still graded.
                logs = [p.read_text() for e in eps for p in
                        (Path(stack.env["TURNSTILE_VAR_DIR"]) / "runs" / str(run_id) / "episodes" / str(e.id)).glob("harness-*.log")]
                # each API's own overflow wording: OpenAI/Codex "context", Anthropic "prompt is too
                # long", Gemini "exceeds the maximum number of tokens"
                overflow = ("context", "too long", "maximum number of tokens")
                assert logs and all(any(w in text.lower() for w in overflow) for text in logs), (name, logs[:1])
                assert all(e.reward == 0.0 and e.exit_status for e in eps), name
            step = s.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id)).one()
            assert step.status == "completed" and step.policy_version == s.get(Run, run_id).policy_version


def test_eval_of_a_trained_checkpoint_gives_a_before_after_table(stack):
    """Train one step, then eval the base model and the step's checkpoint on the same instance."""
    from rich.console import Console

    from app.cli.runs import compare_table

    train = stack.api.post("/api/runs", json={**SMALLEST, "harness": "mini-swe-agent"}).json()["id"]
    assert _finish(stack, train, 420)["status"] == "completed", stack.logs()
    bad = stack.api.post("/api/runs", json={**SMALLEST, "kind": "eval", "harness": "mini-swe-agent",
                                            "model": {"name": "tiny", "checkpoint": "run:999"}})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "model.checkpoint"
    runs = []
    for checkpoint in (None, f"run:{train}"):
        model = {"name": "tiny", "checkpoint": checkpoint} if checkpoint else {"name": "tiny"}
        resp = stack.api.post("/api/runs", json={**SMALLEST, "kind": "eval", "harness": "mini-swe-agent",
                                                 "group_size": 1, "model": model})
        assert resp.status_code == 202, resp.text
        runs.append(_finish(stack, resp.json()["id"], 420))
    before, after = runs
    assert after["status"] == "completed" and after["policy_version"] == 1, after["error"]
    with session_scope() as s:
        def served(run_id):
            return {c.policy_version for c in s.scalars(select(Completion).join(Episode).where(Episode.run_id == run_id))}

        assert served(before["id"]) == {0}  # the base model again, not the train run's last weights
        assert served(after["id"]) == {1}  # every call of the eval was answered by the trained weights
    console = Console(record=True, width=120)
    console.print(compare_table(before, after))
    text = console.export_text()
    assert "synthetic__inflection-1" in text and "pass@k" in text and f"run {after['id']} (run:{train})" in text


def test_agent_timeout_keeps_the_episode_and_grades_it(stack):
    """A harness that outlives its budget is killed; the episode is graded and flagged, not lost."""
    resp = stack.api.post("/api/runs", json={**SMALLEST, "kind": "collect", "harness": "mini-swe-agent",
                                             "group_size": 1, "timeouts": {"agent_s": 2, "grade_s": 300}})
    assert resp.status_code == 202, resp.text
    run = _finish(stack, resp.json()["id"], 300)
    assert run["status"] == "completed", (run["error"], stack.logs())
    with session_scope() as s:
        ep = s.scalars(select(Episode).where(Episode.run_id == run["id"])).one()
        assert ep.status == "completed" and ep.timed_out and ep.exit_status == "timeout"
        assert ep.reward == 0.0 and ep.grading_report and ep.patch is not None
    assert run["summary"]["timed_out_episodes"] == 1
