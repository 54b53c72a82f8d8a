"""Run name, tags and notes over the REST API: set at creation and by PATCH, cleared, searched and
filtered in the runs list (SQLite and PostgreSQL); every bad input a 400 naming its field, with
nothing changed."""
from __future__ import annotations

import datetime as dt

import pytest

from app import create_app
from app.db import session_scope
from app.tables import Run
from support import api_client

REDIS_DB = 10
SIM = {"simulate": {"episode_median_s": 0.1}}


@pytest.fixture
def client(any_database, redis_db):
    return api_client(create_app({"TESTING": True}))


def _run(client, **body) -> dict:
    resp = client.post("/api/runs", json={**SIM, **body})
    assert resp.status_code == 202, resp.get_json()
    return resp.get_json()


def test_labels_at_creation_and_after(client):
    run = _run(client, kind="eval", name="  baseline lr 1e-5 ", tags=["Baseline", "lr-1e-5", "baseline"],
               notes="first try\nwith the demo's settings")
    assert (run["name"], run["tags"], run["notes"]) == ("baseline lr 1e-5", ["baseline", "lr-1e-5"],
                                                          "first try\nwith the demo's settings")
    assert "name" not in run["config"]  # labels are not run options
    with session_scope() as s:
        before = s.get(Run, run["id"]).updated_at
    resp = client.patch(f"/api/runs/{run['id']}", json={"add_tags": ["keep"], "remove_tags": ["lr-1e-5"], "name": "b2"})
    assert resp.status_code == 200, resp.get_json()
    assert (resp.get_json()["name"], resp.get_json()["tags"]) == ("b2", ["baseline", "keep"])
    resp = client.patch(f"/api/runs/{run['id']}", json={"name": None, "notes": "", "tags": []})
    body = resp.get_json()
    assert (body["name"], body["tags"], body["notes"]) == (None, [], None)
    fetched = client.get(f"/api/runs/{run['id']}").get_json()
    assert (fetched["name"], fetched["tags"], fetched["notes"]) == (None, [], None)
    with session_scope() as s:  # a label is no state change: the run's updated_at stays
        assert s.get(Run, run["id"]).updated_at == before


@pytest.mark.parametrize("body, field", [
    ({"name": 3}, "name"),
    ({"name": "a\nb"}, "name"),
    ({"name": "x" * 201}, "name"),
    ({"notes": "x\u0000y"}, "notes"),
    ({"tags": "baseline"}, "tags"),
    ({"tags": ["has space"]}, "tags.0"),
    ({"tags": ["ok", 7]}, "tags.1"),
    ({"add_tags": ["x" * 65]}, "add_tags.0"),
    ({"tags": ["a"], "add_tags": ["b"]}, "tags"),
    ({"nmae": "x"}, "nmae"),
    ({}, None),
])
def test_bad_patch_is_a_400_naming_the_field_and_changes_nothing(client, body, field):
    run = _run(client, name="kept", tags=["kept"])
    resp = client.patch(f"/api/runs/{run['id']}", json=body)
    assert resp.status_code == 400, resp.get_json()
    err = resp.get_json()["error"]
    assert err.get("field") == field and err["message"].startswith("invalid run labels")
    if field == "nmae":
        assert "did you mean 'name'" in err["message"]
    after = client.get(f"/api/runs/{run['id']}").get_json()
    assert (after["name"], after["tags"]) == ("kept", ["kept"])


def test_patch_of_no_json_or_no_run(client):
    run = _run(client)
    resp = client.patch(f"/api/runs/{run['id']}", data="name=x", content_type="text/plain")
    assert resp.status_code == 400 and "JSON object" in resp.get_json()["error"]["message"]
    assert client.patch("/api/runs/99999", json={"name": "x"}).status_code == 404


def test_bad_labels_at_creation_come_with_the_config_problems_and_create_nothing(client):
    resp = client.post("/api/runs", json={**SIM, "name": 5, "tags": ["Not ok"], "group_size": 0})
    assert resp.status_code == 400
    fields = {d["field"] for d in resp.get_json()["error"]["details"]}
    assert {"name", "tags.0", "group_size"} <= fields
    with session_scope() as s:
        assert s.query(Run).count() == 0


def test_runs_list_search_and_filters(client):
    a = _run(client, kind="eval", name="Baseline SmolLM", tags=["baseline", "smol_2"])
    b = _run(client, kind="train", name="lr sweep", tags=["sweep"], notes="Trying a BIGGER learning rate")
    c = _run(client, kind="eval", tags=["smolx2"])  # `smol_2`'s `_` is no wildcard: c never matches it
    with session_scope() as s:
        s.get(Run, c["id"]).status = "failed"
        s.get(Run, c["id"]).finished_at = dt.datetime.now(dt.timezone.utc)

    def ids(**params) -> list[int]:
        resp = client.get("/api/runs", query_string=params)
        assert resp.status_code == 200, resp.get_json()
        return [r["id"] for r in resp.get_json()["runs"]]

    assert ids() == [c["id"], b["id"], a["id"]]
    assert ids(q="baseline") == [a["id"]]          # name, any case
    assert ids(q="bigger") == [b["id"]]            # notes
    assert ids(q="sweep") == [b["id"]]             # name and tag
    assert ids(tag="smol_2") == [a["id"]]
    assert ids(tag="baseline,smol_2") == [a["id"]]  # every tag given
    assert ids(tag=["baseline", "sweep"]) == []
    assert ids(kind="eval") == [c["id"], a["id"]]
    assert ids(status="failed") == [c["id"]]
    assert ids(kind="eval", status="queued", q="smol") == [a["id"]]
    assert ids(q="nothing like it") == []


@pytest.mark.parametrize("params, field", [({"kind": "finetune"}, "kind"), ({"status": "done"}, "status"),
                                           ({"tag": "Not a tag"}, "tag")])
def test_runs_list_bad_filter_is_a_400(client, params, field):
    resp = client.get("/api/runs", query_string=params)
    assert resp.status_code == 400 and resp.get_json()["error"]["field"] == field
