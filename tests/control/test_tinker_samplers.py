"""Sampler checkpoints of Tinker models on real SQL and a real embedded engine: paths as the SDK
parses them, publishing an adapter to the engine, isolation between API keys, and a sample
future answered end to end by the rollout worker's code (claim, resolve, engine, complete)."""
from __future__ import annotations

import pytest
import torch
from sqlalchemy import func, select
from tinker.types.checkpoint import ParsedCheckpointTinkerPath

from app import config
from app.control import tinker_futures, tinker_sample_future
from app.control.tinker_sampling import SampleError
from app.control.tinker_samplers import (ephemeral_name, parse_sampler_path, pick_engine, publish, resolve, sampler_folder,
                                         sampler_path)
from app.db import session_scope
from app.engines.embedded.adapters import TARGETS, save_adapter
from app.tables import Run, TinkerFuture, TinkerModel, TinkerSamplingSession, TinkerSession
from support.engine_process import EngineProcess

PROMPT = [19556, 665, 28, 638, 359]


@pytest.fixture(scope="module")
def engine():
    proc = EngineProcess("tiny")
    yield proc
    proc.stop()


@pytest.fixture
def stack(database, engine, tmp_path, monkeypatch):
    """SQL, a var folder and the engine as the settings' only engine."""
    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("TURNSTILE_ENGINE_URLS", engine.url)
    config.reset_settings()
    tinker_sample_future._bases.clear()
    yield engine
    config.reset_settings()


def _model(key: str) -> tuple[str, int, str]:
    """A Tinker model of `key` on the tiny model: (model id, run id, SDK session id)."""
    with session_scope() as s:
        run = Run(kind="tinker", status="running", config={"kind": "tinker"})
        s.add(run)
        s.flush()
        sess = TinkerSession(id=f"sess-{key}-{run.id}", key_name=key, sdk_version="0.38.0", tags=[], user_metadata={})
        s.add(sess)
        s.flush()
        s.add(TinkerModel(id=f"tinker-{run.id}", run_id=run.id, session_id=sess.id, seq_id=0, key_name=key,
                          base_model="tiny", lora_rank=4))
        return f"tinker-{run.id}", run.id, sess.id


def _write_adapter(run_id: int, name: str, seed: int = 0) -> None:
    """What the gpu task writes for a save: a random rank-4 adapter of the tiny model."""
    from app.engines.modeling import load_model

    model = load_model("tiny")[0]
    gen = torch.Generator().manual_seed(seed)
    weights = {n: (torch.randn(4, m.in_features, generator=gen) * 0.3, torch.randn(m.out_features, 4, generator=gen) * 0.3)
               for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in TARGETS and isinstance(m, torch.nn.Linear)}
    save_adapter(sampler_folder(run_id, name), weights, r=4, alpha=8, policy_version=0)


def _sample_future(key: str, request_id: str, *, model_path: str | None = None, base_model: str | None = None,
                   sampling_session_id: str | None = None) -> int:
    payload = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]}, "num_samples": 2,
               "sampling_params": {"max_tokens": 4, "temperature": 0.0}, "model_path": model_path,
               "base_model": base_model}
    with session_scope() as s:
        return tinker_futures.create(s, model_id=None, request_id=request_id, op="sample", payload=payload,
                                     key_name=key, sampling_session_id=sampling_session_id).id


def _row(future_id: int) -> TinkerFuture:
    with session_scope() as s:
        row = s.get(TinkerFuture, future_id)
        s.expunge(row)
        return row


def test_paths_are_the_sdks():
    path = sampler_path("tinker-3", "sampler-001")
    parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)  # the SDK's own parser
    assert (parsed.training_run_id, parsed.checkpoint_type) == ("tinker-3", "sampler")
    assert parse_sampler_path(path) == ("tinker-3", "sampler-001")
    with pytest.raises(SampleError, match="'weights' checkpoint"):
        parse_sampler_path("tinker://tinker-3/weights/step-1")
    for bad in ("tinker://tinker-3/sampler_weights/../x", "tinker://tinker-3/sampler_weights/a/b", "s3://x/y/z"):
        with pytest.raises(SampleError):
            parse_sampler_path(bad)
    with pytest.raises(SampleError, match="sampler name"):
        sampler_folder(1, "../../etc")


def test_publish_serves_the_adapter_and_a_nameless_save_makes_a_sampling_session(stack):
    model_id, run_id, session_id = _model("alice")
    _write_adapter(run_id, "sampler-001")
    with session_scope() as s:
        out = publish(s, s.get(TinkerModel, model_id), "sampler-001")
    assert out["path"] == f"tinker://{model_id}/sampler_weights/sampler-001"
    served = [a["id"] for a in stack.client.request("GET", "/v1/lora_adapters")["data"]]
    assert any(name.startswith(f"run-{run_id}@") for name in served)
    name = ephemeral_name(session_id, 5)
    assert name == ephemeral_name(session_id, 5) != ephemeral_name(session_id, 6)
    _write_adapter(run_id, name, seed=1)
    with session_scope() as s:
        first = publish(s, s.get(TinkerModel, model_id), name, sampling_seq_id=5)
    with session_scope() as s:  # the same save again (its worker died after the first): the same session
        again = publish(s, s.get(TinkerModel, model_id), name, session_id=session_id, sampling_seq_id=5)
        count = s.scalar(select(func.count()).select_from(TinkerSamplingSession))
        row = s.get(TinkerSamplingSession, first["sampling_session_id"])
        assert (row.key_name, row.model_id, row.model_path) == (
            "alice", model_id, f"tinker://{model_id}/sampler_weights/{name}")
        assert row.session_id == session_id
    assert again["sampling_session_id"] == first["sampling_session_id"] and count == 1
    with session_scope() as s, pytest.raises(SampleError, match="no adapter was written"):
        publish(s, s.get(TinkerModel, model_id), "never-saved")


def test_a_sample_future_is_answered_under_its_checkpoint(stack):
    model_id, run_id, _ = _model("alice")
    _write_adapter(run_id, "s1")
    with session_scope() as s:
        publish(s, s.get(TinkerModel, model_id), "s1")
    tuned = _sample_future("alice", "r-tuned", model_path=f"tinker://{model_id}/sampler_weights/s1")
    base = _sample_future("alice", "r-base", base_model="tiny")
    assert tinker_sample_future.run(tuned) == "completed"
    assert tinker_sample_future.run(tuned) == "skipped"  # a redelivered message: already answered
    assert tinker_sample_future.run(base) == "completed"
    tuned_result, base_result = _row(tuned).result, _row(base).result
    assert len(tuned_result["sequences"]) == 2
    assert tuned_result["sequences"][0]["tokens"] != base_result["sequences"][0]["tokens"]


def test_an_engine_restarted_since_the_save_loads_the_adapter_again(stack):
    model_id, run_id, _ = _model("alice")
    _write_adapter(run_id, "s2", seed=2)
    with session_scope() as s:
        publish(s, s.get(TinkerModel, model_id), "s2")
        target = resolve(s, s.get(TinkerFuture, _sample_future("alice", "r-0", model_path=f"tinker://{model_id}/sampler_weights/s2")))
    stack.client.request("POST", "/v1/unload_lora_adapter", {"lora_name": target.adapter},
                         headers=stack.client._admin_headers())
    future = _sample_future("alice", "r-1", model_path=f"tinker://{model_id}/sampler_weights/s2")
    assert tinker_sample_future.run(future) == "completed", _row(future).error


def test_a_key_samples_only_its_own_checkpoints(stack):
    alice_model, alice_run, alice_session = _model("alice")
    _write_adapter(alice_run, "mine")
    with session_scope() as s:
        ephemeral = publish(s, s.get(TinkerModel, alice_model), "mine", session_id=alice_session, sampling_seq_id=0)
    path = f"tinker://{alice_model}/sampler_weights/mine"
    cases = {
        "another key's checkpoint": _sample_future("bob", "b-1", model_path=path),
        "another key's sampling session": _sample_future("bob", "b-2", sampling_session_id=ephemeral["sampling_session_id"]),
        "a checkpoint never saved": _sample_future("alice", "a-1", model_path=f"tinker://{alice_model}/sampler_weights/none"),
        "a training-state path": _sample_future("alice", "a-2", model_path=f"tinker://{alice_model}/weights/mine"),
        "a base model the engine does not serve": _sample_future("alice", "a-3", base_model="smollm2"),
    }
    for what, future in cases.items():
        assert tinker_sample_future.run(future) == "failed", what
        error = _row(future).error
        assert error["category"] == tinker_futures.USER, what
        assert "alice" not in error["error"] and "/var/" not in error["error"], what  # nothing of the owner leaks
    assert "no model" in _row(cases["another key's checkpoint"]).error["error"]
    assert "no sampling session" in _row(cases["another key's sampling session"]).error["error"]
    own = _sample_future("alice", "a-4", sampling_session_id=ephemeral["sampling_session_id"])
    assert tinker_sample_future.run(own) == "completed"


def test_one_session_goes_to_one_engine():
    urls = ["http://a:1", "http://b:1", "http://c:1"]
    picks = {pick_engine(f"sampler-{i}", urls) for i in range(40)}
    assert picks == set(urls)
    assert pick_engine("sampler-7", urls) == pick_engine("sampler-7", list(reversed(urls)))
