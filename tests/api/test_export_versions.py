"""The run export gives the policy version of every token: completions parallel to `sampled_ids`,
trajectories parallel to `token_ids`, decoded from the runs the gateway stored; and the KV
version where a completion recorded one older than its weights."""
from __future__ import annotations

import json

import pytest

from app import create_app
from app.api.token_versions import lag_class
from app.db import session_scope
from app.tables import Completion, Episode, Run, TaskInstance
from app.training.store import build_episode_trajectories
from support import api_client


@pytest.fixture
def client(database):
    return api_client(create_app({"TESTING": True}))


def _seed() -> int:
    """A collect run with one episode of three calls, merged by prefix merging into one chain:
    call 0 sampled by v1 alone (a row from before per-token capture: no runs), call 1 by v1 then
    v2 (an in-flight update after its 2nd token), call 2 by v2 with its first two tokens'
    KV left from v1 (a `keep` update without recompute)."""
    with session_scope() as s:
        run = Run(kind="collect", config={"harness": "mini-swe-agent", "model": {"name": "tiny"}})
        inst = TaskInstance(task_set="t", instance_id="demo-1", repo="r", record={})
        s.add_all([run, inst])
        s.flush()
        ep = Episode(run_id=run.id, instance_id=inst.id, group_index=0, sample_index=0, status="completed",
                     policy_version=1)
        s.add(ep)
        s.flush()
        prompt = [1, 2, 3]
        calls = [([10, 11], None, None, 1),
                 ([20, 21, 22, 23], [[0, 1], [2, 2]], None, 1),
                 ([30, 31, 32], [[0, 2]], [[0, 1], [2, 2]], 2)]
        for seq, (sampled, runs, kv, version) in enumerate(calls):
            s.add(Completion(episode_id=ep.id, seq=seq, request_key=f"k{seq}", api="chat", raw_request={},
                             normalized_request={"messages": [{"role": "user", "content": "hi"}]},
                             prompt_ids=list(prompt), sampled_ids=sampled, logprobs=[-0.5] * len(sampled),
                             finish_reason="stop", policy_version=version, policy_versions=runs, kv_versions=kv))
            prompt = prompt + sampled + [4]  # the next call extends this one: one merged chain
        s.flush()
        rows, _report = build_episode_trajectories(s, ep.id, "prefix_merging")
        assert len(rows) == 1
        return run.id


def test_export_gives_each_token_its_policy_and_kv_version(client):
    run_id = _seed()
    lines = client.get(f"/api/runs/{run_id}/export").get_data(as_text=True).splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    comps = record["completions"]
    assert [c["token_policy_versions"] for c in comps] == [[1, 1], [1, 1, 2, 2], [2, 2, 2]]
    assert [c["token_kv_versions"] for c in comps] == [None, None, [1, 1, 2]]
    for c in comps:
        assert len(c["token_policy_versions"]) == len(c["sampled_ids"])
    (traj,) = record["trajectories"]
    ids, mask = traj["token_ids"], traj["loss_mask"]
    versions, kv = traj["token_policy_versions"], traj["token_kv_versions"]
    assert len(versions) == len(kv) == len(ids)
    sampled = {tid: (v, k) for tid, m, v, k in zip(ids, mask, versions, kv) if m}
    assert sampled == {10: (1, 1), 11: (1, 1), 20: (1, 1), 21: (1, 1), 22: (2, 2), 23: (2, 2),
                       30: (2, 1), 31: (2, 1), 32: (2, 2)}
    assert all(v is None and k is None for m, v, k in zip(mask, versions, kv) if not m)  # context


def test_episode_view_and_openapi_name_the_fields_in_order(client):
    run_id = _seed()
    line = json.loads(client.get(f"/api/runs/{run_id}/export").get_data(as_text=True).splitlines()[0])
    spec = client.get("/api/openapi.json").get_json()
    schemas = spec["components"]["schemas"]
    assert list(line) == list(schemas["ExportLine"]["properties"])
    assert list(line["trajectories"][0]) == list(schemas["ExportTrajectory"]["properties"])
    media = spec["paths"]["/api/runs/{run_id}/export"]["get"]["responses"]["200"]["content"]["application/x-ndjson"]
    assert media["x-line-schema"] == {"$ref": "#/components/schemas/ExportLine"}
    episode = client.get(f"/api/episodes/{line['id']}").get_json()
    assert episode["completions"][1]["token_policy_versions"] == [1, 1, 2, 2]
    assert "token_kv_versions" in schemas["Completion"]["properties"]


def test_lag_classes_bucket_two_or_more_versions_behind():
    assert [lag_class(v, 5) for v in (5, 4, 3, 0, 6)] == ["lag-0", "lag-1", "lag-2", "lag-2", "lag-0"]
    assert lag_class(None, 5) == lag_class(3, None) == "lag-unknown"
