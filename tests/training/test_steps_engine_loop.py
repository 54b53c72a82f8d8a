"""The real embedded engine (subprocess) and the trainer close the loop:
engine-recorded logprobs = trainer logprobs before the update; after train_step the engine
serves the trained weights under the new policy version."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from sqlalchemy import select

from app.db import session_scope
from app.engines.client import EngineClient
from app.engines.modeling import build_tiny_model
from app.tables import Completion, Episode, Group, TaskInstance
from app.training import steps
from app.training.batching import StepSequence
from app.runconfig import TrainingConfig
from app.training.trainer import Trainer
from support import free_port


@pytest.fixture
def live_engine(var_dir, data):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(data.root)}
    proc = subprocess.Popen([sys.executable, "-m", "app.engines.embedded.server", "--model", "tiny", "--port", str(port)],
                            cwd=data.root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = EngineClient(f"http://127.0.0.1:{port}", timeout=120)
    try:
        client.health(wait_s=120)
        yield client
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def sample(client: EngineClient, messages: list[dict], seed: int) -> dict:
    out = client.chat(messages, max_tokens=8, temperature=1.0, seed=seed, logprobs=True, return_token_ids=True)
    choice = out["choices"][0]
    return {
        "prompt_ids": out["prompt_token_ids"],
        "sampled_ids": choice["token_ids"],
        "logprobs": [entry["logprob"] for entry in choice["logprobs"]["content"]],
        "finish_reason": choice["finish_reason"],
        "text": choice["message"]["content"] or "",
        "policy_version": out["policy_version"],
    }


def record_session(client, episode_id: int, seed: int) -> None:
    messages = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": f"Fix issue {seed}."}]
    with session_scope() as s:
        for turn in range(3):
            c = sample(client, messages, seed * 10 + turn)
            s.add(Completion(episode_id=episode_id, seq=turn, request_key=f"{episode_id}-{turn}", api="chat",
                             raw_request={"messages": messages}, prompt_ids=c["prompt_ids"], sampled_ids=c["sampled_ids"],
                             logprobs=c["logprobs"], finish_reason=c["finish_reason"], policy_version=c["policy_version"]))
            messages = messages + [{"role": "assistant", "content": c["text"]},
                                   {"role": "user", "content": f"Tests still fail ({turn})."}]


def test_engine_parity_and_weight_reload(live_engine, data):
    run_id = data.run([live_engine.base_url])
    with session_scope() as s:
        inst = TaskInstance(task_set="t", instance_id="loop__1", repo="x/x", record={})
        s.add(inst)
        s.flush()
        s.add(Group(run_id=run_id, group_index=0, instance_id=inst.id, status="trained"))
        episodes = [Episode(run_id=run_id, instance_id=inst.id, group_index=0, sample_index=k, status="completed",
                            reward=float(k == 0), resolved=k == 0, policy_version=0) for k in range(2)]
        s.add_all(episodes)
        s.flush()
        episode_ids = [e.id for e in episodes]
    for k, episode_id in enumerate(episode_ids):
        record_session(live_engine, episode_id, seed=k + 1)

    metrics = steps.train_step(run_id, 0, episode_ids)

    # Engine (fp32 CPU, incremental decoding with a KV cache) vs trainer (one padded forward).
    assert metrics["logprob_gap_max_abs"] < 1e-4, metrics["logprob_gap_max_abs"]
    assert metrics["tokens_trained"] == 2 * 3 * 8 - _short_turns(episode_ids)
    merge = metrics["merge"]
    # Random tiny-model text may re-tokenize differently in the next prompt: such a turn
    # starts a new chain (never a silently re-tokenized one); every call is accounted for.
    assert merge["completions"] == 6 and merge["rejected"] == 0
    assert merge["chains"] + merge["completions_merged"] == 6
    assert merge["chains_cut"] == sum(merge["cut_reasons"].values()) == merge["chains"] - 2
    assert metrics["engine_sync"] == {live_engine.base_url: "ok"}
    assert live_engine.policy_version() == 1
    # The engine now samples from the trained weights: its logprobs match the trainer's.
    after = sample(live_engine, [{"role": "user", "content": "Again."}], seed=99)
    assert after["policy_version"] == 1
    seq = StepSequence(after["prompt_ids"] + after["sampled_ids"], [0] * len(after["prompt_ids"]) + [1] * len(after["sampled_ids"]),
                       [0.0] * len(after["prompt_ids"]) + after["logprobs"], 0.0)
    trained = steps._RESIDENT.trainer.logprobs([seq])[0]
    assert torch.allclose(trained, torch.tensor(after["logprobs"]), atol=1e-4)
    base = Trainer(TrainingConfig(), build_tiny_model(0)).logprobs([seq])[0]
    assert not torch.allclose(base, torch.tensor(after["logprobs"]), atol=1e-4)


def _short_turns(episode_ids: list[int]) -> int:
    """Sampled tokens missing from turns that stopped before max_tokens (EOS)."""
    with session_scope() as s:
        rows = s.scalars(select(Completion).where(Completion.episode_id.in_(episode_ids))).all()
        return sum(8 - len(r.sampled_ids) for r in rows)
