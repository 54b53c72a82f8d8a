"""train_step end to end on SQLite: completions -> trajectories -> GRPO step -> checkpoint ->
engines reload -> TrainingStep metrics -> Run.policy_version; idempotence and crash resume.

The engine is a small stdlib HTTP server in a thread that implements the engine's
`POST /v1/load_weights` contract with the engine package's own loader
(`app.engines.modeling.load_weights_into`); the full engine server is tested by its owner.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from sqlalchemy import func, select

from app import config
from app.db import session_scope
from app.engines.modeling import build_tiny_model, load_weights_into
from app.models import Completion, Episode, Group, Run, TaskInstance, Trajectory, TrainingStep
from app.training import steps
from app.training.checkpoints import checkpoint_dir, tensorboard_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def var_dir(database, monkeypatch, tmp_path):
    """A per-test var dir whose models/ is the shared model cache (tokenizer built once)."""
    var = tmp_path / "var"
    var.mkdir()
    shared = ROOT / "var" / "models"
    shared.mkdir(parents=True, exist_ok=True)
    (var / "models").symlink_to(shared)
    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(var))
    config.reset_settings()
    steps.reset_resident()
    yield var
    steps.reset_resident()


class Engine:
    """Serves POST /v1/load_weights by loading the checkpoint into its own tiny model."""

    def __init__(self, hold: threading.Event | None = None):
        self.model = build_tiny_model(seed=0)
        self.loaded: list[tuple[str, int]] = []
        self.received = threading.Event()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.received.set()
                if hold is not None:
                    hold.wait(30)
                load_weights_into(engine.model, body["path"])
                engine.loaded.append((body["path"], body["policy_version"]))
                out = json.dumps({"policy_version": body["policy_version"]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engine():
    server = Engine()
    yield server
    server.close()


def rollout(model, prompt, n, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)
    sampled = ids[len(prompt):]
    return sampled, [float(logp[len(prompt) + i - 1, t]) for i, t in enumerate(sampled)]


def make_run(engine_urls, training=None) -> int:
    with session_scope() as s:
        run = Run(kind="train", status="running", config={
            "model": {"name": "tiny", "engine_urls": engine_urls},
            "training": {"learning_rate": 1e-3, "micro_batch_tokens": 1024, **(training or {})},
        })
        s.add(run)
        s.flush()
        return run.id


def add_group(run_id: int, group_index: int, rewards: list[float], seed: int) -> list[int]:
    """A group of episodes, each with a 3-call session sampled from the tiny model."""
    model = build_tiny_model(seed=0)
    ids = []
    with session_scope() as s:
        inst = s.scalar(select(TaskInstance).where(TaskInstance.instance_id == "demo__1"))
        if inst is None:
            inst = TaskInstance(task_set="t", instance_id="demo__1", repo="demo/demo", record={})
            s.add(inst)
            s.flush()
        s.add(Group(run_id=run_id, group_index=group_index, instance_id=inst.id, status="trained"))
        for k, reward in enumerate(rewards):
            ep = Episode(run_id=run_id, instance_id=inst.id, group_index=group_index, sample_index=k,
                         status="completed", reward=reward, resolved=reward > 0, policy_version=0)
            s.add(ep)
            s.flush()
            prompt = [1, 100 + group_index, 200 + k, 2, 1]
            for turn in range(3):
                sampled, lps = rollout(model, prompt, 6, seed=seed * 100 + k * 10 + turn)
                s.add(Completion(episode_id=ep.id, seq=turn, request_key=f"{ep.id}-{turn}", api="chat",
                                 raw_request={}, prompt_ids=list(prompt), sampled_ids=sampled, logprobs=lps,
                                 finish_reason="stop", policy_version=0))
                prompt = prompt + sampled + [2, 1, 300 + turn, 301, 2, 1]
            ids.append(ep.id)
    return ids


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_train_step_end_to_end_records_everything_and_is_idempotent(var_dir, engine):
    run_id = make_run([engine.url])
    episode_ids = add_group(run_id, 0, [1.0, 0.0], seed=1) + add_group(run_id, 1, [1.0, 1.0], seed=2)

    metrics = steps.train_step(run_id, 0, episode_ids)

    with session_scope() as s:
        row = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id, TrainingStep.step == 0))
        assert row.status == "completed" and row.policy_version == 1 and row.error is None
        assert s.get(Run, run_id).policy_version == 1
        assert row.metrics == json.loads(json.dumps(metrics))
        assert s.scalar(select(func.count()).select_from(Trajectory)) == 4  # one chain per episode
        episode = s.get(Episode, episode_ids[0])
        assert episode.merge_stats["prefix_merging"]["completions_merged"] == 2
    assert metrics["episodes"] == 4 and metrics["groups"] == 2 and metrics["sequences"] == 4
    assert metrics["reward_mean"] == 0.75 and metrics["resolved_rate"] == 0.75
    assert metrics["zero_advantage_group_fraction"] == 0.5
    assert metrics["tokens_trained"] == 4 * 3 * 6
    assert metrics["merge"]["chains"] == 4 and metrics["merge"]["completions"] == 12
    assert metrics["logprob_gap_max_abs"] < 1e-4  # recorded with a plain forward of the same weights
    assert metrics["engine_sync"] == {engine.url: "ok"}
    for key in ("loss", "clip_fraction", "kl", "advantage_mean", "advantage_std", "grad_norm", "step_time_s"):
        assert key in metrics

    ckpt = checkpoint_dir(run_id, 0)
    for name in ("model/model.safetensors", "model/config.json", "optimizer.pt", "trainer_state.json"):
        assert (ckpt / name).is_file(), name
    assert list(tensorboard_dir(run_id).glob("events.out.tfevents.*"))
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


def test_resume_after_crash_matches_uninterrupted_run(var_dir, engine):
    """Two steps with the worker 'restarted' in between equal two steps in one process
    bit for bit: the weights *and* the AdamW state came back from the checkpoint."""
    final = {}
    for crash in (False, True):
        steps.reset_resident()
        run_id = make_run([engine.url])
        first = add_group(run_id, 0, [1.0, 0.0], seed=1)
        second = add_group(run_id, 1, [0.0, 1.0], seed=2)
        steps.train_step(run_id, 0, first)
        if crash:
            steps.reset_resident()  # a fresh worker process: nothing resident
        metrics = steps.train_step(run_id, 1, second)
        assert metrics["policy_version"] == 2
        final[crash] = weights(steps._RESIDENT.trainer.model)
        final[(crash, "adam")] = steps._RESIDENT.trainer.optimizer.state_dict()["state"][0]["exp_avg_sq"].clone()
    assert all(torch.equal(final[False][k], final[True][k]) for k in final[False])
    assert torch.equal(final[(False, "adam")], final[(True, "adam")])


def test_worker_killed_during_weight_sync_resumes_without_retraining(var_dir):
    hold = threading.Event()
    engine = Engine(hold=hold)
    try:
        run_id = make_run([engine.url])
        episode_ids = add_group(run_id, 0, [1.0, 0.0], seed=1)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        code = f"from app.training.steps import train_step; train_step({run_id}, 0, {episode_ids})"
        worker = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env)
        try:
            assert engine.received.wait(120), "the worker never reached the weight sync"
            worker.send_signal(signal.SIGKILL)  # the gpu worker dies mid-sync
            worker.wait(30)
        finally:
            if worker.poll() is None:
                worker.kill()
        hold.set()
        with session_scope() as s:
            row = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id))
            assert row.status == "training" and s.get(Run, run_id).policy_version == 0
        saved = json.loads((checkpoint_dir(run_id, 0) / "trainer_state.json").read_text())
        mtime = (checkpoint_dir(run_id, 0) / "trainer_state.json").stat().st_mtime_ns

        metrics = steps.train_step(run_id, 0)  # the step is sent again to a new worker

        assert metrics["resumed_from_checkpoint"] is True
        assert metrics["loss"] == saved["metrics"]["loss"]  # not retrained: the saved result is used
        assert (checkpoint_dir(run_id, 0) / "trainer_state.json").stat().st_mtime_ns == mtime
        with session_scope() as s:
            row = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id))
            assert row.status == "completed" and s.get(Run, run_id).policy_version == 1
        assert engine.loaded[-1] == (str(checkpoint_dir(run_id, 0) / "model"), 1)
    finally:
        hold.set()
        engine.close()
