"""train_step end to end on SQLite: completions -> trajectories -> GRPO step -> checkpoint ->
engines reload -> TrainingStep metrics -> Run.policy_version; idempotence and crash resume.
(The engine endpoint is the stdlib server of conftest.py.)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from sqlalchemy import func, select

from app.api.trainer_state import trainer_state
from app.db import session_scope
from app.engines.modeling import build_tiny_model
from app.paths import RunPaths
from app.tables import Episode, Run, Trajectory, TrainingStep
from app.training import steps


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_chains_policy_lag_counts_from_its_oldest_sampling_version():
    from types import SimpleNamespace as Row

    assert steps.policy_lag(Row(meta={"policy_versions": [3, 2, None]}), 4) == 2
    assert steps.policy_lag(Row(meta={"policy_versions": [4, 4]}), 4) == 0
    assert steps.policy_lag(Row(meta={"policy_versions": [None]}), 4) == 0  # the engine did not say
    assert steps.policy_lag(Row(meta=None), 4) == 0 and steps.policy_lag(Row(meta={"policy_versions": [1]}), None) == 0


def test_train_step_end_to_end_records_everything_and_is_idempotent(var_dir, engine, data):
    run_id = data.run([engine.url])
    episode_ids = data.group(run_id, 0, [1.0, 0.0], seed=1) + data.group(run_id, 1, [1.0, 1.0], seed=2)

    metrics = steps.train_step(run_id, 0, episode_ids)

    with session_scope() as s:
        row = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id, TrainingStep.step == 0))
        assert row.status == "completed" and row.policy_version == 1 and row.error is None
        waited = (row.started_at - row.created_at).total_seconds()
        assert abs(row.metrics["scheduling"]["gpu_queue_wait_s"] - waited) < 1e-3  # created -> started
        assert s.get(Run, run_id).policy_version == 1
        assert row.metrics == {**json.loads(json.dumps(metrics)), "scheduling": row.metrics["scheduling"]}
        assert s.scalar(select(func.count()).select_from(Trajectory)) == 4  # one chain per episode
        episode = s.get(Episode, episode_ids[0])
        assert episode.merge_stats["prefix_merging"]["completions_merged"] == 2
    assert metrics["episodes"] == 4 and metrics["groups"] == 2 and metrics["sequences"] == 4
    assert metrics["reward_mean"] == 0.75 and metrics["resolved_rate"] == 0.75
    assert metrics["zero_advantage_group_fraction"] == 0.5
    assert metrics["tokens_trained"] == 4 * 3 * 6
    assert metrics["merge"]["chains"] == 4 and metrics["merge"]["completions"] == 12
    assert metrics["logprob_gap_max_abs"] < 1e-4  # recorded with a plain forward of the same weights
    assert metrics["tokens_stale"] == 0  # sampled by version 0, the weights the step trained from
    assert metrics["engine_sync"] == {engine.url: "ok"} and metrics["engine_sync_failed"] == []
    for key in ("loss", "clip_fraction", "kl", "advantage_mean", "advantage_std", "grad_norm", "step_time_s"):
        assert key in metrics

    ckpt = RunPaths(run_id).checkpoint(0)
    for name in ("model/model.safetensors", "model/config.json", "optimizer.pt", "trainer_state.json"):
        assert (ckpt / name).is_file(), name
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tensorboard.util.tensor_util import make_ndarray

    events = EventAccumulator(str(RunPaths(run_id).tensorboard))
    events.Reload()
    scalars = events.Tags()["tensors"]  # TensorBoard's torch-free writer stores scalars as tensor summaries
    for tag in ("train/loss", "train/reward_mean", "train/logprob_gap_max_abs", "train/merge/chains"):
        assert tag in scalars, tag
    (loss,) = events.Tensors("train/loss")
    assert loss.step == 0 and float(make_ndarray(loss.tensor_proto)) == pytest.approx(metrics["loss"], rel=1e-6)
    # The engine loaded exactly the trained weights.
    assert engine.loaded == [(str(ckpt / "model"), 1)]
    trained = steps._RESIDENT.trainer.model
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in trained.state_dict().items())
    assert not torch.equal(engine.model.state_dict()["model.layers.0.mlp.up_proj.weight"],
                           build_tiny_model(0).state_dict()["model.layers.0.mlp.up_proj.weight"])

    # A redelivered step does nothing: same metrics, no new checkpoint, no second reload.
    mtime = (ckpt / "trainer_state.json").stat().st_mtime_ns
    assert steps.train_step(run_id, 0) == row.metrics
    assert (ckpt / "trainer_state.json").stat().st_mtime_ns == mtime and len(engine.loaded) == 1


def test_resume_after_crash_matches_uninterrupted_run(var_dir, engine, data):
    """Two steps with the worker 'restarted' in between equal two steps in one process
    bit for bit: the weights *and* the AdamW state came back from the checkpoint."""
    final = {}
    for crash in (False, True):
        steps.reset_resident()
        run_id = data.run([engine.url])
        first = data.group(run_id, 0, [1.0, 0.0], seed=1)
        second = data.group(run_id, 1, [0.0, 1.0], seed=2)
        steps.train_step(run_id, 0, first)
        if crash:
            steps.reset_resident()  # a fresh worker process: nothing resident
        metrics = steps.train_step(run_id, 1, second)
        assert metrics["policy_version"] == 2
        final[crash] = weights(steps._RESIDENT.trainer.model)
        final[(crash, "adam")] = steps._RESIDENT.trainer.optimizer.state_dict()["state"][0]["exp_avg_sq"].clone()
    assert all(torch.equal(final[False][k], final[True][k]) for k in final[False])
    assert torch.equal(final[(False, "adam")], final[(True, "adam")])


def test_worker_killed_during_weight_sync_resumes_without_retraining(var_dir, data):
    hold = threading.Event()
    engine = data.Engine(hold=hold)
    try:
        run_id = data.run([engine.url])
        episode_ids = data.group(run_id, 0, [1.0, 0.0], seed=1)
        env = {**os.environ, "PYTHONPATH": str(data.root)}
        code = f"from app.training.steps import train_step; train_step({run_id}, 0, {episode_ids})"
        worker = subprocess.Popen([sys.executable, "-c", code], cwd=data.root, env=env)
        try:
            assert engine.received.wait(120), "the worker never reached the weight sync"
            with session_scope() as s:  # while the engine loads: the row says the weights are being pushed
                row = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id))
                assert (row.status, row.checkpoint_path) == ("training", str(RunPaths(run_id).checkpoint(0)))
                assert trainer_state(s, s.get(Run, run_id), [row])["text"] == "step 0 pushing weights"
            worker.send_signal(signal.SIGKILL)  # the gpu worker dies mid-sync
            worker.wait(30)
        finally:
            if worker.poll() is None:
                worker.kill()
        hold.set()
        with session_scope() as s:
            row = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id))
            assert row.status == "training" and s.get(Run, run_id).policy_version == 0
        saved = json.loads((RunPaths(run_id).checkpoint(0) / "trainer_state.json").read_text())
        mtime = (RunPaths(run_id).checkpoint(0) / "trainer_state.json").stat().st_mtime_ns

        metrics = steps.train_step(run_id, 0)  # the step is sent again to a new worker

        assert metrics["resumed_from_checkpoint"] is True
        assert metrics["loss"] == saved["metrics"]["loss"]  # not retrained: the saved result is used
        assert (RunPaths(run_id).checkpoint(0) / "trainer_state.json").stat().st_mtime_ns == mtime
        with session_scope() as s:
            row = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id))
            assert row.status == "completed" and s.get(Run, run_id).policy_version == 1
        assert engine.loaded[-1] == (str(RunPaths(run_id).checkpoint(0) / "model"), 1)
    finally:
        hold.set()
        engine.close()


def test_failed_step_keeps_its_row_with_the_error_and_bad_config_is_reported(var_dir, engine, data):
    run_id = data.run([engine.url])
    good = data.group(run_id, 0, [1.0, 0.0], seed=1)
    with pytest.raises(LookupError, match=r"episodes \[999999\] are not episodes of run"):
        steps.train_step(run_id, 0, good + [999999])
    with session_scope() as s:
        row = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id))
        assert row.status == "training" and row.error.startswith("LookupError: episodes [999999]")
    assert steps._RESIDENT.trainer is None  # nothing half-trained stays resident
    other = data.run([engine.url], training={"clip_hgh": 0.3})
    # A stored config that no longer validates (the API rejects it at creation) fails the step by name.
    with pytest.raises(ValueError, match=r"training\.clip_hgh\s+Extra inputs are not permitted"):
        steps.train_step(other, 0, good)


def test_a_failed_weight_sync_fails_the_step_and_the_run_by_name(var_dir, data, engine, redis_db):
    """Under `keep` (the default mode), an engine that does not load the step's weights after its
    retries fails the step by name: status `failed`, error "weight sync failed: <url>: <reason>",
    shown by the REST API, and the run fails with it at its next tick.  The checkpoint stays; the
    engine that did load is named ok; the run's version is not moved to weights a failed engine
    does not serve; running the step again does not retrain it."""
    from app import create_app
    from app.control import scheduler
    from support import api_client

    dead = "http://127.0.0.1:9"  # discard port: nothing listens, connections are refused at once
    run_id = data.run([engine.url, dead])
    episode_ids = data.group(run_id, 0, [1.0, 0.0], seed=1)
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run.run_config().model.weight_update_mode == "keep"
        run.summary = {"instance_ids": [s.get(Episode, episode_ids[0]).instance_id]}  # started: the scheduler plans it
    with pytest.raises(steps.WeightSyncError, match=r"^weight sync failed: http://127\.0\.0\.1:9: \S") as err:
        steps.train_step(run_id, 0, episode_ids)
    assert engine.url not in str(err.value)
    assert engine.loaded == [(str(RunPaths(run_id).checkpoint(0) / "model"), 1)]  # the live engine loaded it
    with session_scope() as s:
        row = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id))
        assert row.status == "failed" and row.error == str(err.value)
        assert row.metrics["engine_sync_failed"] == [dead] and row.metrics["engine_sync"][engine.url] == "ok"
        assert row.checkpoint_path == str(RunPaths(run_id).checkpoint(0)) and row.policy_version == 1
        assert s.get(Run, run_id).policy_version == 0
    with pytest.raises(steps.StepError, match="failed before: weight sync failed"):
        steps.train_step(run_id, 0)

    client = api_client(create_app({"TESTING": True}))
    shown = client.get(f"/api/runs/{run_id}").get_json()
    assert [(st["status"], st["error"]) for st in shown["steps"]] == [("failed", str(err.value))]
    scheduler.tick(run_id)
    shown = client.get(f"/api/runs/{run_id}").get_json()
    assert shown["status"] == "failed" and shown["error"] == f"training step 0 failed: {err.value}"
    page = client.get(f"/runs/{run_id}")  # the run page: the run's error and the step's, in its steps table
    assert page.status_code == 200 and page.get_data(as_text=True).count("weight sync failed: http://127.0.0.1:9") == 2