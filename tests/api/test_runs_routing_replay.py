"""Run creation refuses training.routing_replay where it cannot apply: a dense policy, or a vLLM
server that returns no routed experts (real API app, SQLite, real HTTP to the fake vLLM); the
MoE shape comes from the spec or config.json, without torch."""
from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select

from app import create_app
from app.cli import main
from app.db import session_scope
from app.engines.moe_config import MoEShape, moe_shape, shape_of_config
from app.tables import Run
from support import api_client

REDIS_DB = 10
SIM = {"simulate": {"episode_median_s": 0.1}, "kind": "train"}


@pytest.fixture
def client(database, redis_db):
    return api_client(create_app({"TESTING": True}))


def _runs() -> int:
    with session_scope() as s:
        return s.scalar(select(func.count()).select_from(Run))


def _replay(model: dict) -> dict:
    return {**SIM, "model": model, "training": {"routing_replay": True}}


@pytest.mark.parametrize("name", ["tiny", "smollm2"])
def test_replay_on_a_dense_model_is_400_naming_the_field(client, name):
    resp = client.post("/api/runs", json=_replay({"name": name}))
    assert resp.status_code == 400, resp.get_json()
    err = resp.get_json()["error"]
    assert err["field"] == "training.routing_replay"
    assert "dense" in err["message"] and repr(name) in err["message"]
    assert _runs() == 0


def test_replay_on_the_tiny_moe_is_created_and_stored(client):
    resp = client.post("/api/runs", json=_replay({"name": "tiny-moe"}))
    assert resp.status_code == 202, resp.get_json()
    assert resp.get_json()["config"]["training"]["routing_replay"] is True
    off = client.post("/api/runs", json={**SIM, "model": {"name": "tiny"}})
    assert off.status_code == 202 and off.get_json()["config"]["training"]["routing_replay"] is False


def test_replay_is_refused_for_a_vllm_server_without_routed_experts(client):
    """`vllm serve --enable-return-routed-experts` is server-wide: a server without it answers a
    completion without `routed_experts`.  The server is `support.fake_vllm.FakeVLLM` (vLLM's CPU
    build cannot start with the flag: docs/moe.md)."""
    from support.fake_vllm import FakeVLLM

    without, with_routes = FakeVLLM(routes=False), FakeVLLM(routes=True)
    try:
        def create(url):
            return client.post("/api/runs", json={"kind": "train", "harness": "mini-swe-agent", "model": {
                "name": "Qwen/Qwen3-30B-A3B", "engine": "vllm", "engine_urls": [url]},
                "training": {"routing_replay": True, "lora": True}})

        refused = create(without.url)
        assert refused.status_code == 400, refused.get_json()
        err = refused.get_json()["error"]
        assert err["field"] == "training.routing_replay"
        assert without.url in err["message"] and "--enable-return-routed-experts" in err["message"]
        assert ("POST", "/v1/completions") in without.calls and _runs() == 0
        assert create(with_routes.url).status_code == 202
    finally:
        without.close()
        with_routes.close()


def test_submit_exits_2_naming_routing_replay(client, monkeypatch, tmp_path, capsys):
    from app.cli import client as cli_client
    import httpx
    from support import AUTH

    flask_app = create_app({"TESTING": True})
    monkeypatch.setattr(cli_client, "api_client", lambda: httpx.Client(transport=httpx.WSGITransport(app=flask_app),
                                                                      base_url="http://api", headers=AUTH))
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_replay({"name": "tiny"})))
    assert main(["submit", "--config", str(path)]) == 2
    assert "training.routing_replay" in capsys.readouterr().err
    assert _runs() == 0


def test_moe_shape_from_the_spec_or_config_json(tmp_path):
    assert moe_shape("tiny-moe") == MoEShape(2, 2, 8) and moe_shape("tiny-moe-wide") == MoEShape(2, 4, 32)
    assert moe_shape("tiny") is None and moe_shape("smollm2") is None
    qwen3_30b = {"num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
                 "mlp_only_layers": []}
    assert shape_of_config(qwen3_30b) == MoEShape(48, 8, 128)
    assert shape_of_config({**qwen3_30b, "mlp_only_layers": [0, 1]}) == MoEShape(46, 8, 128)
    assert shape_of_config({"num_hidden_layers": 61, "n_routed_experts": 256, "num_experts_per_tok": 8,
                            "first_k_dense_replace": 3}) == MoEShape(58, 8, 256)
    assert shape_of_config({"num_hidden_layers": 30, "hidden_size": 576}) is None
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 32, "num_local_experts": 8,
                                                      "num_experts_per_tok": 2}))
    assert moe_shape(tmp_path) == MoEShape(32, 2, 8)
    with pytest.raises(LookupError, match="no config.json"):
        moe_shape("Qwen/Qwen3-30B-A3B")


def test_the_tiny_moe_folder_matches_the_torch_free_shape():
    from app.engines.modeling import ensure_tiny_moe_folder

    assert moe_shape(ensure_tiny_moe_folder("tiny-moe")) == moe_shape("tiny-moe")


def test_the_moe_demo_config_is_a_valid_replay_run(client):
    """demo/moe-replay.json (the tiny MoE through the whole stack) passes run creation's checks
    of routing replay, the model and the instances (simulated here: the same config, no stack)."""
    from app.cli.client import read_config_file
    from app.config import ROOT

    config = read_config_file(str(ROOT / "demo" / "moe-replay.json"))
    assert config["model"]["name"] == "tiny-moe" and config["training"]["routing_replay"] is True
    resp = client.post("/api/runs?dry_run=true", json={**config, "simulate": {"episode_median_s": 0.1}})
    assert resp.status_code == 200, resp.get_json()
