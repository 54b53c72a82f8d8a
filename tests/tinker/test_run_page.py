"""A Tinker model is a run of kind tinker: `GET /api/runs/<id>`, the run page and `turnstile runs`
show its optimizer steps, losses and sampler checkpoints, read from its futures."""
from __future__ import annotations

import httpx
import tinker
from sqlalchemy import select

from app import create_app
from app.cli import client as cli_client
from app.cli.runs import cmd_runs
from app.control import tinker_futures
from app.db import session_scope
from app.tables import TinkerFuture, TinkerModel
from support import AUTH, api_client

SDK = {"X-Stainless-Package-Version": tinker.__version__}


def _op(url: str, api_key: str, route: str, body: dict, result: dict) -> None:
    """Send one op as the SDK does and finish its future as the worker would."""
    resp = httpx.post(f"{url}/api/v1/{route}", json=body, headers={**SDK, "X-API-Key": api_key})
    assert resp.status_code == 200, resp.text
    with session_scope() as s:
        row = tinker_futures.get(s, resp.json()["request_id"])
        assert tinker_futures.complete(s, row.id, result)


def test_run_page_api_and_cli_show_the_tinker_model(tinker_url, key, monkeypatch, capsys):
    alice = key("alice")
    tc = tinker.ServiceClient(base_url=tinker_url, api_key=alice).create_lora_training_client(
        base_model="tiny", rank=8).result(timeout=60)
    model_id = tc.get_info().model_id
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
             "loss_fn_inputs": {"target_tokens": {"data": [2, 3], "dtype": "int64", "shape": [2]}}}
    fb = {"model_id": model_id, "seq_id": 1, "forward_backward_input": {"loss_fn": "cross_entropy", "data": [datum]}}
    optim = {"model_id": model_id, "adam_params": {"learning_rate": 1e-3}}
    for loss in (2.5, 1.5):
        _op(tinker_url, alice, "forward_backward", fb, {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": [],
                                                        "metrics": {"loss:sum": loss}})
        _op(tinker_url, alice, "optim_step", optim, {"metrics": {}})
    sampler = f"tinker://{model_id}/sampler_weights/after-two"
    _op(tinker_url, alice, "save_weights_for_sampler", {"model_id": model_id, "path": "after-two"},
        {"path": sampler, "type": "save_weights_for_sampler"})
    with session_scope() as s:
        run_id = s.get(TinkerModel, model_id).run_id
        assert len(s.scalars(select(TinkerFuture).where(TinkerFuture.model_id == model_id)).all()) == 6

    app = create_app({"TESTING": True})
    client = api_client(app)
    got = client.get(f"/api/runs/{run_id}").get_json()
    assert got["kind"] == "tinker"
    t = got["tinker"]
    assert (t["model_id"], t["steps"], t["base_model"], t["lora_rank"]) == (model_id, 2, "tiny", 8)
    assert [(p["step"], p["value"]) for p in t["losses"]] == [(0, 2.5), (1, 1.5)]
    assert [(c["path"], c["after_step"]) for c in t["sampler_checkpoints"]] == [(sampler, 2)]

    page = client.get(f"/runs/{run_id}").get_data(as_text=True)
    assert f"Tinker model {model_id}" in page and sampler in page
    assert 'id="tinker-steps">2<' in page

    monkeypatch.setattr(cli_client, "api_client", lambda: httpx.Client(transport=httpx.WSGITransport(app=app),
                                                                      base_url="http://api", headers=AUTH))

    class Args:
        limit = 50
        kind = "tinker"
        status = search = tag = None

    monkeypatch.setenv("COLUMNS", "200")
    assert cmd_runs(Args()) == 0
    out = capsys.readouterr().out
    assert "tinker" in out and "tiny LoRA r8" in out
