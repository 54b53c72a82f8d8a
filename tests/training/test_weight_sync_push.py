"""Checkpoints sent to an embedded engine over HTTP with SHA-256 digests (`TURNSTILE_WEIGHT_TRANSFER`):
a training step's checkpoint reaches a real engine server (tiny model, in a thread) without the
engine reading the trainer's folder, the engine then serves exactly those weights, and a digest
that does not match is refused by the engine and named on the step."""
from __future__ import annotations

import threading

import flask
import httpx
import pytest
import torch
from sqlalchemy import select
from werkzeug.serving import make_server

from app import config
from app.db import session_scope
from app.engines.embedded.server import create_engine_app
from app.engines.embedded.uploads import upload_root
from app.engines.modeling import read_state_dict
from app.engines.client import weights_label
from app.tables import TrainingStep
from app.training import steps, weight_sync
from support import AUTH, API_TOKEN


@pytest.fixture
def pushed_engine(var_dir, monkeypatch):
    """A real embedded engine (tiny model) on a free port, with every request path recorded."""
    monkeypatch.setenv("TURNSTILE_WEIGHT_TRANSFER", "push")
    config.reset_settings()
    app = create_engine_app("tiny", admin_token=API_TOKEN, engine_id="pushed-engine")
    seen: list[str] = []
    app.before_request(lambda: seen.append(f"{flask.request.method} {flask.request.path}"))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    app.url = f"http://127.0.0.1:{server.server_port}"
    app.seen = seen
    yield app
    server.shutdown()
    config.reset_settings()


def _served_version(engine) -> int:
    return httpx.get(f"{engine.url}/v1/policy_version").json()["policy_version"]


def test_a_step_pushes_its_checkpoint_and_the_engine_serves_exactly_it(pushed_engine, data):
    run_id = data.run([pushed_engine.url])
    episode_ids = data.group(run_id, 0, [1.0, 0.0], seed=1)
    metrics = steps.train_step(run_id, 0, episode_ids)
    assert metrics["engine_sync"] == {pushed_engine.url: "ok"}, metrics["engine_sync"]
    assert _served_version(pushed_engine) == 1
    # The engine names the weights as the trainer does (never having seen the trainer's folder).
    named = httpx.get(f"{pushed_engine.url}/v1/policy_version").json()["weights"]
    assert named == weights_label(steps_checkpoint(run_id))
    # Only the HTTP transfer was used: never the load-by-path route that reads the trainer's folder.
    assert "POST /v1/load_weights" not in pushed_engine.seen
    files = sorted(p.name for p in steps_checkpoint(run_id).iterdir())
    assert "model.safetensors" in files
    assert sorted(p for p in pushed_engine.seen if p.startswith("PUT")) == [f"PUT /v1/checkpoints/1/{f}" for f in files]
    engine = pushed_engine.config["ENGINE"]
    served = engine.model.state_dict()
    for name, tensor in read_state_dict(steps_checkpoint(run_id)).items():
        assert torch.equal(served[name], tensor), name
    assert not any(upload_root(engine).glob("v1/*"))  # received files are gone once loaded


def steps_checkpoint(run_id: int):
    from app.paths import RunPaths

    return RunPaths(run_id).checkpoint(0) / "model"


def test_a_digest_mismatch_is_refused_by_the_engine_and_the_step_says_so(pushed_engine, data, monkeypatch):
    true_digests = weight_sync.checkpoint_digests

    def one_wrong(path):
        digests = true_digests(path)
        digests["model.safetensors"] = "0" * 64  # what a corrupted or substituted file looks like
        return digests

    monkeypatch.setattr(weight_sync, "checkpoint_digests", one_wrong)
    run_id = data.run([pushed_engine.url])
    with pytest.raises(steps.WeightSyncError) as failed:  # the step fails by name
        steps.train_step(run_id, 0, data.group(run_id, 0, [1.0, 0.0], seed=1))
    assert str(failed.value).startswith(f"weight sync failed: {pushed_engine.url}: PUT /v1/checkpoints/1/")
    with session_scope() as s:
        metrics = s.scalar(select(TrainingStep.metrics).where(TrainingStep.run_id == run_id))
    result = metrics["engine_sync"][pushed_engine.url]
    assert result.startswith("error: PUT /v1/checkpoints/1/model.safetensors: 400 ")
    assert "sha256 mismatch" in result and "refused" in result and "0" * 64 in result
    assert metrics["engine_sync_failed"] == [pushed_engine.url]
    assert _served_version(pushed_engine) == 0  # still the old weights
    engine = pushed_engine.config["ENGINE"]
    assert not (upload_root(engine) / "v1" / "model.safetensors").exists()
    assert not list(upload_root(engine).glob("v1/.*.partial"))


def test_the_load_refuses_a_manifest_that_does_not_match_what_was_received(pushed_engine, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    digest = weight_sync.checkpoint_digests(tmp_path)["config.json"]
    base = f"{pushed_engine.url}/v1/checkpoints/7"
    put = httpx.put(f"{base}/config.json", content=b"{}", headers={**AUTH, "X-Turnstile-Sha256": digest})
    assert put.status_code == 201
    load = httpx.post(f"{base}/load", json={"sha256": {"config.json": "f" * 64}}, headers=AUTH)
    assert load.status_code == 400 and "sha256 mismatch" in load.json()["error"]["message"]
    missing = httpx.post(f"{base}/load", json={"sha256": {"config.json": digest, "model.safetensors": digest}},
                         headers=AUTH)
    assert "model.safetensors of version 7 was not received" in missing.json()["error"]["message"]
    assert httpx.put(f"{base}/config.json", content=b"{}", headers={"X-Turnstile-Sha256": digest}).status_code == 401
    assert httpx.put(f"{base}/..secret", content=b"", headers={**AUTH, "X-Turnstile-Sha256": digest}).status_code == 400


@pytest.mark.parametrize("mode, url, pushes", [
    ("auto", "http://127.0.0.1:8200", False), ("auto", "http://localhost:8200", False),
    ("auto", "http://[::1]:8200", False), ("auto", "http://10.31.0.3:8200", True),
    ("auto", "http://engine-0.engine.rl.svc:8200", True), ("path", "http://10.31.0.3:8200", False),
    ("push", "http://127.0.0.1:8200", True),
])
def test_which_engines_get_the_checkpoint_over_http(monkeypatch, mode, url, pushes):
    monkeypatch.setenv("TURNSTILE_WEIGHT_TRANSFER", mode)
    config.reset_settings()
    try:
        assert weight_sync.pushes_to(url) is pushes
    finally:
        config.reset_settings()
