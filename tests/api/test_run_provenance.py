"""REST API: where each setting came from is stored with the run and shown in its JSON; `dry_run` checks
a config without creating a run.  Real API app, real database and Redis."""
from __future__ import annotations

import json

import pytest

from app import create_app
from app.db import session_scope
from app.provenance import HEADER
from app.tables import Run
from support import api_client

REDIS_DB = 10
SIM = {"simulate": {"episode_median_s": 0.1}}


@pytest.fixture
def client(database, redis_db):
    return api_client(create_app({"TESTING": True}))


def _count() -> int:
    with session_scope() as s:
        return s.query(Run).count()


def test_body_settings_are_api_the_rest_default(client):
    resp = client.post("/api/runs", json={**SIM, "kind": "eval", "model": {"name": "tiny"}})
    assert resp.status_code == 202, resp.get_json()
    origins = resp.get_json()["provenance"]
    assert origins["kind"] == "api" and origins["model.name"] == "api" and origins["simulate.episode_median_s"] == "api"
    assert origins["model.engine"] == "default" and origins["group_size"] == "default"
    # every leaf of the stored config has a source, and the record is the same when read back
    stored = resp.get_json()["config"]
    assert set(origins) >= {"training.learning_rate", "scheduling.share", "timeouts.agent_s"}
    assert client.get(f"/api/runs/{resp.get_json()['id']}").get_json()["provenance"] == origins
    assert stored["model"]["engine"] == "embedded"


def test_a_clients_claim_labels_only_what_its_body_holds(client):
    claim = {"kind": "--set", "model.name": "file", "group_size": "file", "harness": "default", "steps": "forged"}
    resp = client.post("/api/runs", json={**SIM, "kind": "eval", "model": {"name": "tiny"}, "harness": "codex",
                                          "steps": 1}, headers={HEADER: json.dumps(claim)})
    assert resp.status_code == 202, resp.get_json()
    origins = resp.get_json()["provenance"]
    assert origins["kind"] == "--set" and origins["model.name"] == "file"
    assert origins["group_size"] == "default"  # not in the body: a claim cannot make a default look chosen
    assert origins["harness"] == "api" and origins["steps"] == "api"  # not a client source: the body's


def test_a_malformed_claim_falls_back_to_the_body(client):
    resp = client.post("/api/runs", json={**SIM, "kind": "eval"}, headers={HEADER: "{not json"})
    assert resp.status_code == 202 and resp.get_json()["provenance"]["kind"] == "api"


def test_dry_run_checks_everything_and_creates_nothing(client):
    ok = client.post("/api/runs?dry_run=1", json={**SIM, "kind": "eval"})
    assert ok.status_code == 200 and ok.get_json()["provenance"]["kind"] == "api"
    bad = client.post("/api/runs?dry_run=1", json={"harness": "mini-swe-agnt", "task_set": "startr",
                                                   "instances": ["x"]})
    err = bad.get_json()["error"]
    assert bad.status_code == 400
    fields = {d["field"]: d["message"] for d in err["details"]}
    assert "did you mean 'mini-swe-agent'?" in fields["harness"] and "did you mean 'starter'?" in fields["task_set"]
    assert _count() == 0


@pytest.mark.parametrize("value", ["yes please", "2", "dry"])
def test_a_mistyped_dry_run_is_a_400_naming_it_and_creates_nothing(client, value):
    resp = client.post(f"/api/runs?dry_run={value}", json={**SIM, "kind": "eval"})
    assert resp.status_code == 400 and resp.get_json()["error"]["field"] == "dry_run"
    assert _count() == 0
    assert client.post("/api/runs?dry_run=false", json={**SIM, "kind": "eval"}).status_code == 202  # 0/false: created
    assert _count() == 1


def test_an_eval_runs_priority_the_body_gives_is_kept(client):
    """Eval runs default to priority 5, but an explicit 0 is the user's and wins."""
    chosen = client.post("/api/runs", json={**SIM, "kind": "eval", "priority": 0}).get_json()
    default = client.post("/api/runs", json={**SIM, "kind": "eval"}).get_json()
    assert chosen["priority"] == 0 and chosen["provenance"]["priority"] == "api"
    assert default["priority"] == 5 and default["provenance"]["priority"] == "default"


def test_provenance_is_stored_on_sqlite_and_postgresql(any_database, redis_db):
    api = api_client(create_app({"TESTING": True}))
    resp = api.post("/api/runs", json={**SIM, "kind": "eval", "training": {"lora": True}},
                    headers={HEADER: json.dumps({"training.lora": "--set"})})
    assert resp.status_code == 202, resp.get_json()
    with session_scope() as s:
        stored = s.get(Run, resp.get_json()["id"]).provenance
    assert stored["training.lora"] == "--set" and stored["training.lora_r"] == "default" and stored["kind"] == "api"
