"""The whole pipeline for real at the smallest size (issue 7): REST run -> Celery workers ->
harness subprocess in its sandbox -> gateway -> engine (tiny model) -> grading of a bundled
instance -> prefix-merged GRPO step on the gpu queue -> checkpoint -> engine reload -> completed.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from app.control.preflight import EMBEDDED_CONTEXT
from app.control.stages import HARNESS_FAILED
from app.db import session_scope
from app.harnesses import get_preset
from app.tables import Completion, Episode, Run, TrainingStep, Trajectory
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

    return wait_for(done, timeout, interval=1, what=lambda: f"run {run_id} to finish\n{stack.logs()}")


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


def test_other_harnesses_complete_a_train_run_or_are_refused_at_creation(stack):
    """Each other preset at the smallest size: a harness whose measured minimum prompt does not fit
    the model's 8k context is refused with a 400 naming both numbers; the others are captured,
    graded and trained."""
    names = [n for n in HARNESSES if n != "mini-swe-agent"]
    missing = [n for n in names if not get_preset(n).is_installed()]
    if missing:
        pytest.fail(f"harness CLIs not installed: {missing}; run `make ci-deps`")
    run_ids, refused = {}, []
    for name in names:
        resp = stack.api.post("/api/runs", json={**SMALLEST, "harness": name,
                                                 "scheduling": {"rollout_slots": 2}})
        need = get_preset(name).min_prompt_tokens
        if need is not None and need >= EMBEDDED_CONTEXT:
            assert resp.status_code == 400, (name, resp.text)
            err = resp.json()["error"]
            assert err["field"] == "harness" and f"at least {need} tokens" in err["message"], err
            assert f"{EMBEDDED_CONTEXT}-token context" in err["message"], err
            refused.append(name)
            continue
        assert resp.status_code == 202, resp.text
        run_ids[name] = resp.json()["id"]
    assert "codex" in refused and run_ids  # Codex's first prompt alone exceeds SmolLM2's context
    for name, run_id in run_ids.items():
        run = _finish(stack, run_id, 900)
        assert run["status"] == "completed", (name, run["error"], stack.logs())
        with session_scope() as s:
            eps = s.scalars(select(Episode).where(Episode.run_id == run_id)).all()
            assert {e.status for e in eps} == {"completed"}, name
            comps = s.scalars(select(Completion).join(Episode).where(Episode.run_id == run_id)).all()
            assert comps, name  # every graded episode made at least one usable model call
            api = get_preset(name).api
            assert {c.api for c in comps} == {api}, (name, [c.api for c in comps])
            for c in comps:
                assert c.sampled_ids and len(c.sampled_ids) == len(c.logprobs), (name, c.error)
            step = s.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id)).one()
            assert step.status == "completed" and step.policy_version == s.get(Run, run_id).policy_version
            assert step.metrics["scheduling"]["episodes_harness_failed"] == 0


def test_eval_of_a_trained_checkpoint_gives_a_before_after_table(stack):
    """Train one step, then eval the base model and the step's checkpoint on the same instance."""
    from rich.console import Console

    from app.cli.compare import compare_table

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
    assert "synthetic__inflection-1" in text and "solved instances" in text and f"run {after['id']} (run:{train})" in text


def test_agent_timeout_keeps_the_episode_and_grades_it(stack):
    """A harness that outlives its budget after making model calls is killed; the episode is graded
    and flagged, not lost.

    Deterministic: once the episode's first completion is recorded, the test closes the engine's
    weight-reload gate (as the trainer does during a reload), so the harness's next call is held
    by the gateway until the agent budget runs out.  Each call samples up to 400 tokens, so the
    gate is closed while the second call is still generating, before a third one is sent.
    """
    import redis

    from app.weight_gate import gate_key

    resp = stack.api.post("/api/runs", json={**SMALLEST, "kind": "collect", "harness": "mini-swe-agent",
                                             "group_size": 1, "budget": {"max_turns": 20, "max_tokens": 400},
                                             "timeouts": {"agent_s": 60, "grade_s": 300}})
    assert resp.status_code == 202, resp.text
    run_id = resp.json()["id"]

    def first_call():
        with session_scope() as s:
            return s.scalar(select(Completion.id).join(Episode).where(Episode.run_id == run_id).limit(1))

    gate = redis.Redis.from_url(stack.env["REDIS_URL"])
    key = gate_key(stack.env["TURNSTILE_ENGINE_URLS"])
    try:
        wait_for(first_call, 60, interval=0.05, what=lambda: f"the first model call of run {run_id}\n{stack.logs()}")
        gate.set(key, 1, ex=120)
        wait_for(lambda: stack.api.get(f"/api/runs/{run_id}").json()["episodes_by_status"].get("running") is None,
                 90, interval=0.5, what="the rollout to end")
    finally:
        gate.delete(key)
    run = _finish(stack, run_id, 300)
    assert run["status"] == "completed", (run["error"], stack.logs())
    with session_scope() as s:
        ep = s.scalars(select(Episode).where(Episode.run_id == run["id"])).one()
        assert ep.status == "completed" and ep.timed_out and ep.exit_status == "timeout"
        assert ep.reward == 0.0 and ep.grading_report and ep.patch is not None and ep.error is None
        comps = s.scalars(select(Completion).where(Completion.episode_id == ep.id)).all()
        assert comps and all(c.sampled_ids for c in comps)  # the calls made before the timeout
    assert run["summary"]["timed_out_episodes"] == 1 and run["summary"]["episodes_harness_failed"] == 0


def _long_statement_task_set(path: Path) -> str:
    """A copy of the bundled instance whose problem statement (a pasted log) alone overflows the
    8k context: ~1,600 lines, about 20k SmolLM2 tokens.  Returns the task set's path."""
    from app.tasksets import load_task_set

    record = dict(next(r for r in load_task_set("synthetic").raw if r["instance_id"] == SMALLEST["instances"][0]))
    log = "\n".join(f"ordinalize({n}) -> {n}th  # checked against the table, row {n}" for n in range(1600))
    record.update(instance_id="synthetic__inflection-1-long-log",
                  problem_statement=record["problem_statement"] + "\n\nFull output of my check script:\n" + log)
    path.write_text(json.dumps(record) + "\n")
    return str(path)


def test_harness_failures_are_not_reward_0_and_stop_the_run(stack, tmp_path):
    """Two real ways a harness makes no usable model call, through the whole pipeline: its budget
    ends before any call is answered (agent_s=1), and its first prompt overflows the context (a
    problem statement larger than 8k tokens).  Each episode is failed with the cause and the log's
    tail, never graded, never trained; each run stops with one clear error naming the cause."""
    timeout_run = stack.api.post("/api/runs", json={**SMALLEST, "harness": "mini-swe-agent",
                                                    "timeouts": {"agent_s": 1, "grade_s": 300}})
    overflow_run = stack.api.post("/api/runs", json={**SMALLEST, "harness": "mini-swe-agent",
                                                     "task_set": _long_statement_task_set(tmp_path / "long.jsonl"),
                                                     "instances": ["synthetic__inflection-1-long-log"]})
    assert timeout_run.status_code == overflow_run.status_code == 202, (timeout_run.text, overflow_run.text)
    causes = {
        timeout_run.json()["id"]: "mini-swe-agent was killed at its 1 s time limit (timeouts.agent_s) "
                                  "before any model call was answered",
        overflow_run.json()["id"]: "mini-swe-agent exited 1: its first prompt did not fit the model's context "
                                   "window (the gateway answered with a context-length error)",
    }
    for run_id, cause in causes.items():
        run = _finish(stack, run_id, 420)
        assert run["status"] == "failed", (run["status"], run["error"], stack.logs())
        match = re.fullmatch(r"harness mini-swe-agent failed before any usable model call in (\d+) of (\d+) "
                             r"finished episodes: (.*)", run["error"])
        assert match and match[1] == match[2] and int(match[1]) >= 2 and match[3] == cause, run["error"]
        assert run["summary"]["episodes_harness_failed"] == int(match[1])
        with session_scope() as s:
            failed = s.scalars(select(Episode).where(Episode.run_id == run_id, Episode.status == "failed")).all()
            assert len(failed) == int(match[1])
            for ep in failed:
                assert ep.reward is None and ep.resolved is None and ep.grading_report is None  # not a reward 0
                assert ep.error.startswith(HARNESS_FAILED + cause + "\n--- harness log tail (")
                log = Path(stack.env["TURNSTILE_VAR_DIR"]) / "runs" / str(run_id) / "episodes" / str(ep.id) / \
                    f"harness-attempt{ep.attempts}.log"
                assert f"({log})" in ep.error and ep.error.endswith(log.read_text()[-1000:])  # the log's own tail
                assert ep.exit_status and ep.session_token_hash is None and ep.rollout_finished_at
                assert not s.scalars(select(Completion).where(Completion.episode_id == ep.id,
                                                              func.length(Completion.sampled_ids) > 0)).all()
            assert not s.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id)).all()
            assert not s.scalars(select(Trajectory).join(Episode).where(Episode.run_id == run_id)).all()
