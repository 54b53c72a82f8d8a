"""Training fixtures shared by tests/training and tests/workers: a per-test var dir, an engine endpoint, seeded runs.

`engine` is a small stdlib HTTP server in a thread implementing the engine's
`POST /v1/load_weights` contract with the engine package's own loader
(`app.engines.modeling.load_weights_into`).  It is used where a test must hold the reload
request open at a precise moment (killing the trainer mid-sync) or inspect the loaded
tensors; test_training_engine_loop.py runs the real engine server as a subprocess.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from app.config import ROOT
from types import SimpleNamespace

import pytest
import torch
from sqlalchemy import select

from app import config
from app.db import session_scope
from app.engines.modeling import build_tiny_model, load_weights_into
from app.tables import Completion, Episode, Group, Run, TaskInstance
from app.training import steps


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
    """Serves POST /v1/load_weights by loading the checkpoint into its own tiny model, and
    POST /v1/load_lora_adapter by recording (name, folder, policy version) in `adapters`."""

    def __init__(self, hold: threading.Event | None = None):
        self.model = build_tiny_model(seed=0)
        self.loaded: list[tuple[str, int]] = []
        self.adapters: list[tuple[str, str, int | None]] = []
        self.received = threading.Event()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.received.set()
                if hold is not None:
                    hold.wait(30)
                if self.path == "/v1/load_lora_adapter":  # a LoRA run's adapter: recorded, base weights kept
                    engine.adapters.append((body["lora_name"], body["lora_path"], body.get("policy_version")))
                    out = json.dumps({"loaded": body["lora_name"]}).encode()
                else:
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


@pytest.fixture
def data():
    """`data.run(engine_urls, training)` -> run id; `data.group(run_id, index, rewards, seed)` -> episode ids."""
    return SimpleNamespace(run=make_run, group=add_group, root=ROOT, Engine=Engine)


@pytest.fixture
def teacher_dir(tmp_path):
    """A teacher checkpoint of the student's architecture and tokenizer (another random init)."""
    from app.engines.modeling import build_tiny_model, save_weights

    return str(save_weights(build_tiny_model(seed=1), tmp_path / "teacher"))
