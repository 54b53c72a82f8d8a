"""An engine restarted under a run that started from a checkpoint gets that checkpoint back.

A real embedded engine (tiny model) is killed and started again on its port, as a crashed engine
process is; it then serves its own base weights as policy version 0, the very version a warm-
started train run gives its starting checkpoint.  The watchdog's resync must tell the two apart by
the weights name the engine reports, load the starting checkpoint before the run's LoRA adapter,
and so answer exactly as before the restart; the gateway must not load the adapter on the wrong
base in the meantime."""
from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import torch

from app.auth import auth_header
from app.control import engine_resync
from app.control.real_stages import RealStages
from app.db import session_scope
from app.engines.client import EngineClient, weights_label
from app.engines.embedded.adapters import peft_weights, save_adapter
from app.engines.lora_format import adapter_name
from app.engines.modeling import build_tiny_model, save_weights
from app.tables import Run, TrainingStep
from app.training import policy
from app.training.weight_sync import push_adapter, push_weights
from support import free_port

PROMPT = [5, 17, 300, 42, 7, 99, 1000, 23, 8, 64, 12, 77]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class RestartableEngine:
    """A real engine subprocess on a fixed port that can be killed and started again."""

    def __init__(self, spawn):
        self.spawn, self.port = spawn, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.start()

    def start(self):
        self.proc = self.spawn([sys.executable, "-m", "app.engines.embedded.server", "--model", "tiny",
                                "--port", str(self.port), "--threads", "1"], name="engine")
        with EngineClient(self.url, timeout=60) as client:
            client.health(wait_s=120)

    def restart(self):
        self.proc.kill()  # SIGKILL: the process dies as a crashed engine does
        self.start()

    def serving(self) -> tuple[int, str | None]:
        with EngineClient(self.url, timeout=30) as client:
            return client.serving()

    def adapters(self) -> list[str]:
        return [a["id"] for a in httpx.get(f"{self.url}/v1/lora_adapters", timeout=30).json()["data"]]

    def greedy(self, model: str) -> tuple[list[int], list[float]]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1,
                "return_token_ids": True, "ignore_eos": True}
        choice = httpx.post(f"{self.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@pytest.fixture
def restartable(spawn):
    return RestartableEngine(spawn)


def warm_checkpoint(folder, version: int = 3):
    """The tiny model with its weights moved (a warm start differs from the engine's own base)."""
    model = build_tiny_model(0)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    save_weights(model, folder, {"policy_version": version})
    return folder


def lora_step(run_id: int, checkpoint, step: int = 0, version: int = 1) -> str:
    """A completed LoRA step of `run_id` whose checkpoint holds a nonzero adapter; its served name."""
    peft_model = policy.add_lora(build_tiny_model(0), 4, 8, 0.0)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    folder = checkpoint / "adapter"
    save_adapter(folder, peft_weights({k: v for k, v in peft_model.state_dict().items() if "lora_" in k}), 4, 8, version)
    name = adapter_name(f"run-{run_id}", folder)
    with session_scope() as s:
        s.add(TrainingStep(run_id=run_id, step=step, status="completed", policy_version=version,
                           checkpoint_path=str(checkpoint), metrics={"adapter": name}))
    return name


def started_run(url: str, checkpoint, lora: bool, kind: str = "train", **extra) -> int:
    """A running run whose start loaded `checkpoint` into the engine (the real start stage)."""
    config = {"kind": kind, "model": {"name": "tiny", "engine_urls": [url], "checkpoint": str(checkpoint)},
              "training": {"lora": lora}, **extra}
    with session_scope() as s:
        run = Run(kind=kind, status="running", config=config)
        s.add(run)
        s.flush()
        run_id = run.id
    with session_scope() as s:
        cfg = s.get(Run, run_id).run_config()
    RealStages().setup_engines(run_id, cfg, [])
    return run_id


def test_a_restarted_engine_is_put_back_on_the_runs_newest_weights(database, tmp_path, spawn):
    """An engine that (re)started on its base weights (version 0) while a run's step 0 produced
    version 1 is re-synced by the watchdog to that checkpoint; an engine already on it is left alone."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    spawn([sys.executable, "-m", "app.engines.embedded.server", "--model", "tiny", "--port", str(port), "--threads", "1"],
          name="engine")
    client = EngineClient(url, timeout=60)
    client.health(wait_s=120)
    step_dir = tmp_path / "checkpoints" / "step_0"
    save_weights(build_tiny_model(seed=7), step_dir / "model", {"policy_version": 1})
    with session_scope() as s:
        run = Run(kind="train", status="running", policy_version=1,
                  config={"model": {"name": "tiny", "engine_urls": [url]}})
        s.add(run)
        s.flush()
        s.add(TrainingStep(run_id=run.id, step=0, status="completed", policy_version=1,
                           checkpoint_path=str(step_dir)))
    assert client.policy_version() == 0  # as after a restart
    assert engine_resync.resync_engines() == {url: "ok"}
    assert client.policy_version() == 1
    assert engine_resync.resync_engines() == {}  # nothing to do any more
    client.close()


def test_a_restarted_engine_gets_a_warm_lora_runs_start_then_its_adapter(database, tmp_path, restartable):
    from app.proxy.errors import GatewayError
    from app.proxy.upstream import EngineTarget, Upstream

    warm = warm_checkpoint(tmp_path / "warm" / "model")
    run_id = started_run(restartable.url, warm, lora=True)
    with session_scope() as s:
        assert s.get(Run, run_id).start_weights() == (weights_label(warm), 0)  # a train run numbers its start 0
    assert restartable.serving() == (0, weights_label(warm))
    name = lora_step(run_id, tmp_path / "step_0")
    assert push_adapter([restartable.url], tmp_path / "step_0" / "adapter", name, 1) == {restartable.url: "ok"}
    assert engine_resync.resync_engines() == {}  # everything in place: nothing to do
    before = restartable.greedy(name)

    restartable.restart()
    assert restartable.serving() == (0, "tiny") and restartable.adapters() == []  # version 0, but not the run's 0
    # The gateway finds the adapter gone, and must not load it on a base it was not trained on.
    up = Upstream([restartable.url])
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0.0}
    with pytest.raises(GatewayError) as refused:
        up.complete(EngineTarget(restartable.url), body, None)
    assert "does not exist" in str(refused.value) and restartable.adapters() == []

    assert engine_resync.resync_engines() == {restartable.url: "ok"}
    assert restartable.serving() == (0, weights_label(warm)) and restartable.adapters() == [name]
    after = restartable.greedy(name)
    assert after[0] == before[0]
    assert max(abs(a - b) for a, b in zip(after[1], before[1])) < 1e-5  # the same policy, not just the same tokens
    assert engine_resync.resync_engines() == {}
    # On the right base, the gateway itself loads a lost adapter again and answers.
    httpx.post(f"{restartable.url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=auth_header(),
               timeout=30).raise_for_status()
    assert restartable.adapters() == []
    assert up.complete(EngineTarget(restartable.url), body, None)["policy_version"] == 1
    assert restartable.adapters() == [name]


def test_the_final_eval_of_a_finished_lora_run_keeps_that_runs_start_and_adapter(database, tmp_path, restartable):
    """The final held-out eval (`eval_of`) of a LoRA run loads nothing itself: it samples the
    engines as the train run left them, also once that run has completed."""
    warm = warm_checkpoint(tmp_path / "warm" / "model")
    train_id = started_run(restartable.url, warm, lora=True)
    name = lora_step(train_id, tmp_path / "step_0")
    with session_scope() as s:
        s.get(Run, train_id).status = "completed"
        s.add(Run(kind="eval", status="running", config={
            "kind": "eval", "model": {"name": "tiny", "engine_urls": [restartable.url]},
            "eval_of": {"run": train_id, "step": 1}}))
    restartable.restart()
    assert engine_resync.resync_engines() == {restartable.url: "ok"}
    assert restartable.serving() == (0, weights_label(warm)) and restartable.adapters() == [name]


def test_a_full_weights_run_before_its_first_step_gets_its_start_back(database, tmp_path, restartable):
    warm = warm_checkpoint(tmp_path / "warm" / "model")
    started_run(restartable.url, warm, lora=False)
    restartable.restart()
    assert restartable.serving() == (0, "tiny")
    assert engine_resync.resync_engines() == {restartable.url: "ok"}
    assert restartable.serving() == (0, weights_label(warm))
    assert engine_resync.resync_engines() == {}
    # The trainer pushes step 0 while the pass still sees no completed step: a newer version is
    # left alone, not replaced by the start (the next pass sees the step).
    step_model = save_weights(build_tiny_model(seed=9), tmp_path / "step_0" / "model", {"policy_version": 1})
    assert push_weights([restartable.url], step_model, 1) == {restartable.url: "ok"}
    assert engine_resync.resync_engines() == {}
    assert restartable.serving() == (1, weights_label(step_model))


def test_an_eval_of_a_checkpoint_gets_it_back_at_the_checkpoints_version(database, tmp_path, restartable):
    warm = warm_checkpoint(tmp_path / "warm" / "model", version=7)
    run_id = started_run(restartable.url, warm, lora=False, kind="eval")
    with session_scope() as s:
        assert s.get(Run, run_id).start_weights() == (weights_label(warm), 7)
    restartable.restart()
    assert engine_resync.resync_engines() == {restartable.url: "ok"}
    assert restartable.serving() == (7, weights_label(warm))


def test_runs_that_want_different_starts_on_one_engine_are_left_alone(database, tmp_path, restartable):
    """Two running runs started from different checkpoints on the same engine cannot both be
    served: re-syncing would load one and then the other on every pass, so neither start is
    pushed; a third run's trained step on that engine is still put back."""
    first = warm_checkpoint(tmp_path / "a" / "model")
    second = warm_checkpoint(tmp_path / "b" / "model")
    started_run(restartable.url, first, lora=False)
    started_run(restartable.url, second, lora=False)
    restartable.restart()
    assert engine_resync.resync_engines() == {}
    assert restartable.serving() == (0, "tiny")
    third = started_run(restartable.url, first, lora=False)
    step_model = save_weights(build_tiny_model(seed=9), tmp_path / "step_0" / "model", {"policy_version": 1})
    with session_scope() as s:
        s.add(TrainingStep(run_id=third, step=0, status="completed", policy_version=1,
                           checkpoint_path=str(step_model.parent)))
    restartable.restart()
    assert engine_resync.resync_engines() == {restartable.url: "ok"}
    assert restartable.serving() == (1, weights_label(step_model))


def test_needs_follow_running_runs_only(database, tmp_path):
    """Seeded states: a queued run, a cancelled run and a run from the engines' own base need no
    start; an `eval_of` eval of a running train run is that run's need, listed once."""
    url = "http://127.0.0.1:9"  # never called: this reads the database only
    with session_scope() as s:
        train = Run(kind="train", status="running", config={"kind": "train", "model": {"engine_urls": [url]}},
                    summary={"start_weights": {"path": "/ckpt/warm", "policy_version": 0}})
        queued = Run(kind="train", status="queued", config={"kind": "train", "model": {"engine_urls": [url]}},
                     summary={"start_weights": {"path": "/ckpt/other", "policy_version": 0}})
        cancelled = Run(kind="train", status="cancelled", config={"kind": "train", "model": {"engine_urls": [url]}})
        base = Run(kind="eval", status="running", config={"kind": "eval", "model": {"engine_urls": [url]}})
        s.add_all([train, queued, cancelled, base])
        s.flush()
        s.add(Run(kind="eval", status="running", config={"kind": "eval", "model": {"engine_urls": [url]},
                                                         "eval_of": {"run": train.id, "step": 0}}))
        ids = {"train": train.id, "base": base.id}
    needs = {need.run_id: need for need in engine_resync.running_needs()}
    assert sorted(needs) == sorted(ids.values())
    assert needs[ids["train"]].start == (Path("/ckpt/warm"), 0) and needs[ids["train"]].step is None
    assert needs[ids["base"]].start is None and needs[ids["base"]].urls == (url,)
