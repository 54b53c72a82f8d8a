"""REST API: validation errors name the field and write nothing; runs, episodes, export, OpenAPI."""
from __future__ import annotations

import base64
import datetime as dt
import json
import os
import subprocess
import sys

import pytest
from sqlalchemy import func, select

from app import create_app
from app.db import session_scope
from app.tables import Completion, Episode, Run, TaskInstance, utcnow
from support import ROOT, api_client

REDIS_DB = 10


@pytest.fixture
def client(database, redis_db):
    return api_client(create_app({"TESTING": True}))


def _runs_in_db() -> int:
    with session_scope() as s:
        return s.scalar(select(func.count()).select_from(Run))


SIM = {"simulate": {"episode_median_s": 0.1}}


@pytest.mark.parametrize(
    "body, field",
    [
        ({**SIM, "group_size": 0}, "group_size"),
        ({**SIM, "group_size": "four"}, "group_size"),
        ({**SIM, "tasks_per_step": -1}, "tasks_per_step"),
        ({**SIM, "steps": None}, "steps"),
        ({**SIM, "harness": "vim"}, "harness"),
        ({**SIM, "kind": "finetune"}, "kind"),
        ({**SIM, "group_sise": 4}, "group_sise"),
        ({**SIM, "timeouts": {"agent_s": 0}}, "timeouts.agent_s"),
        ({**SIM, "mode": "turbo"}, "mode"),
        ({**SIM, "kind": "train", "group_size": 1}, "group_size"),
        ({**SIM, "model": {"engine": "vllm"}}, "model.engine_urls"),
        ({**SIM, "group_size": True}, "group_size"),
        ({**SIM, "instances": []}, "instances"),
        ({**SIM, "kind": "train", "steps": 0}, "steps"),
        # The training section is typed and strict: caught at creation, never at the first GPU step.
        ({**SIM, "training": {"clip_hgh": 0.3}}, "training.clip_hgh"),
        ({**SIM, "training": {"lora": "false"}}, "training.lora"),
        ({**SIM, "training": {"learning_rate": "abc"}}, "training.learning_rate"),
        ({**SIM, "training": {"learning_rate": 0}}, "training.learning_rate"),
        ({**SIM, "training": {"builder": "concat"}}, "training.builder"),
        ({**SIM, "training": {"tis_cap": 0.5}}, "training.tis_cap"),
        ({**SIM, "training": {"off_policy_correction": "seq_tiss"}}, "training.off_policy_correction"),
        ({**SIM, "training": {"off_policy_correction": ["token_tis", "geo_mask", "sequence"]}},
         "training.off_policy_correction"),
        ({**SIM, "training": {"off_policy_correction": ["token_tis", "seq_tis"]}}, "training.off_policy_correction"),
        ({**SIM, "training": {"off_policy_correction": "icepop", "icepop_bounds": [1.2, 2.0]}},
         "training.icepop_bounds"),
        ({**SIM, "training": {"geo_mask_bounds": [0.9, 1.1]}}, "training.geo_mask_bounds"),
        ({**SIM, "training": {"geo_mask_boundz": [0.9, 1.1]}}, "training.geo_mask_boundz"),
        ({**SIM, "task_set": "x" * (1024 * 1024)}, "task_set"),
        ({**SIM, "instances": ["i" * 300]}, "instances.0"),
        ({**SIM, "scheduling": {"share": 0}}, "scheduling.share"),
        ({**SIM, "scheduling": {"share": "nan"}}, "scheduling.share"),
        ({**SIM, "model": {"weight_update_mode": "pause"}}, "model.weight_update_mode"),
        ({**SIM, "model": {"weight_update_mode": None}}, "model.weight_update_mode"),
        ({**SIM, "model": {"recompute_kv": "sometimes"}}, "model.recompute_kv"),
    ],
)
def test_bad_run_config_is_400_naming_the_field(client, body, field):
    resp = client.post("/api/runs", json=body)
    assert resp.status_code == 400, resp.get_json()
    err = resp.get_json()["error"]
    assert err["field"] == field
    assert field.split(".")[-1] in err["message"]
    assert _runs_in_db() == 0


def test_unknown_off_policy_correction_names_the_value_and_the_choices(client):
    resp = client.post("/api/runs", json={**SIM, "training": {"off_policy_correction": ["geo_mask", "seq_tiss"]}})
    assert resp.status_code == 400, resp.get_json()
    err = resp.get_json()["error"]
    assert err["field"] == "training.off_policy_correction"
    assert "'seq_tiss'" in err["message"] and all(n in err["message"] for n in ("token_tis", "seq_mis", "icepop"))
    assert _runs_in_db() == 0


def test_off_policy_correction_is_stored_as_a_list_with_its_bounds(client):
    """One name stands for a list of one; the stored config holds every bound (defaults included)."""
    resp = client.post("/api/runs", json={**SIM, "kind": "eval", "training": {"off_policy_correction": "geo_mask"}})
    assert resp.status_code == 202, resp.get_json()
    training = resp.get_json()["config"]["training"]
    assert training["off_policy_correction"] == ["geo_mask"]
    assert training["geo_mask_bounds"] == [0.99, 1.01] and training["tis_cap"] == 2.0
    resp = client.post("/api/runs", json={**SIM, "kind": "eval"})
    assert resp.get_json()["config"]["training"]["off_policy_correction"] == ["token_tis"]


def test_training_defaults_are_stored_and_published(client):
    """Defaults live in one place (`TrainingConfig`): the stored run shows them, the schema documents them."""
    resp = client.post("/api/runs", json={**SIM, "kind": "eval", "training": {"learning_rate": 2e-5}})
    assert resp.status_code == 202, resp.get_json()
    training = resp.get_json()["config"]["training"]
    assert training["learning_rate"] == 2e-5 and training["builder"] == "prefix_merging" and training["lora"] is False
    spec = client.get("/api/openapi.json").get_json()
    schemas = spec["components"]["schemas"]
    assert "TrainingConfig" in schemas, sorted(schemas)
    assert schemas["TrainingConfig"]["properties"]["clip_high"]["default"] == 0.28


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b"null"])
def test_malformed_body_is_400(client, raw):
    resp = client.post("/api/runs", data=raw, content_type="application/json")
    assert resp.status_code == 400
    assert "JSON object" in resp.get_json()["error"]["message"]
    assert _runs_in_db() == 0


def test_unknown_task_set_is_400(client):
    resp = client.post("/api/runs", json={"task_set": "/nonexistent/tasks.jsonl", "harness": "mini-swe-agent"})
    assert resp.status_code == 400
    assert resp.get_json()["error"]["field"] == "task_set"
    assert _runs_in_db() == 0


@pytest.mark.parametrize("body, field, words", [
    ({"instances": ["nope"]}, "instances", "no instance"),
    ({"model": {"name": "gpt-9"}}, "model.name", "embedded engine serves"),
    ({"model": {"name": "tiny", "checkpoint": "run:999"}, "kind": "eval"}, "model.checkpoint", "no checkpoint"),
])
def test_config_checked_against_this_installation(client, body, field, words):
    resp = client.post("/api/runs", json={"harness": "mini-swe-agent", **body})
    assert resp.status_code == 400, resp.get_json()
    err = resp.get_json()["error"]
    assert err["field"] == field and words in err["message"]
    assert _runs_in_db() == 0


def test_keep_is_refused_for_a_vllm_server_that_cannot_pause(client):
    """A full-weights train run with weight_update_mode keep (the default) on a vLLM server without
    the pause routes is a 400 naming model.weight_update_mode; with them, or in mode wait, the run
    is created.  The servers are `support.fake_vllm.FakeVLLM`, real HTTP servers answering as
    vLLM 0.32 does with and without VLLM_SERVER_DEV_MODE (a CPU vLLM takes minutes to start, and
    one without its pause routes would be a second one)."""
    from support.fake_vllm import FakeVLLM

    old, new = FakeVLLM(pause_routes=False), FakeVLLM()
    try:
        def create(url, **model):
            return client.post("/api/runs", json={"kind": "train", "harness": "mini-swe-agent", "model": {
                "name": "HuggingFaceTB/SmolLM2-135M-Instruct", "engine": "vllm", "engine_urls": [url], **model}})

        refused = create(old.url)
        assert refused.status_code == 400, refused.get_json()
        err = refused.get_json()["error"]
        assert err["field"] == "model.weight_update_mode"
        assert old.url in err["message"] and "/pause" in err["message"] and "VLLM_SERVER_DEV_MODE" in err["message"]
        assert old.calls == [("GET", "/is_paused")] and _runs_in_db() == 0
        assert create(new.url).status_code == 202
        assert create(old.url, weight_update_mode="wait").status_code == 202
        assert new.calls == [("GET", "/is_paused")] and not new.paused  # asking changed nothing
    finally:
        old.close()
        new.close()


@pytest.mark.parametrize("task_set", ["/", "/dev/zero", "/etc/passwd", "../../../etc"])
def test_task_set_paths_outside_the_allowed_folders_are_refused_at_once(client, task_set, monkeypatch):
    """A run config cannot make the server scan or read arbitrary host files (nor echo them): the
    path is refused before any file under it is listed (every scan and read of a task set goes
    through `app.tasksets.loader._task_files`)."""
    from app.tasksets import loader

    listed = []
    task_files = loader._task_files
    monkeypatch.setattr(loader, "_task_files", lambda path: listed.append(path) or task_files(path))
    resp = client.post("/api/runs", json={"task_set": task_set, "harness": "mini-swe-agent"})
    assert listed == []
    assert resp.status_code == 400
    err = resp.get_json()["error"]
    assert err["field"] == "task_set" and "allowed folder" in err["message"] and len(err["message"]) < 1000
    assert "passwd" not in err["message"] or task_set == "/etc/passwd"
    assert _runs_in_db() == 0


def test_task_set_limits_on_size_and_records(client, tmp_path, monkeypatch):
    from app import config

    record = (ROOT / "data" / "tasks" / "synthetic.jsonl").read_text().splitlines()[0]
    many = tmp_path / "many.jsonl"
    many.write_text("\n".join([record] * 3))
    monkeypatch.setenv("TURNSTILE_TASK_SET_MAX_RECORDS", "2")
    config.reset_settings()
    resp = client.post("/api/runs", json={"task_set": str(many), "harness": "mini-swe-agent"})
    assert resp.status_code == 400 and "more than 2 records" in resp.get_json()["error"]["message"]
    monkeypatch.setenv("TURNSTILE_TASK_SET_MAX_BYTES", "100")
    config.reset_settings()
    resp = client.post("/api/runs", json={"task_set": str(many), "harness": "mini-swe-agent"})
    assert resp.status_code == 400 and "above the limit of 100" in resp.get_json()["error"]["message"]
    config.reset_settings()


def test_bad_task_set_file_is_400_without_echoing_it(client, tmp_path):
    bad = tmp_path / "tasks.jsonl"
    bad.write_text("\n".join(f'{{"instance_id": "x{i}", "secret": "{"s" * 100}"}}' for i in range(50)))
    resp = client.post("/api/runs", json={"task_set": str(bad)})
    assert resp.status_code == 400
    err = resp.get_json()["error"]
    assert err["field"] == "task_set" and len(err["message"]) < 700


def test_list_limit_is_validated(client):
    assert client.get("/api/runs?limit=abc").status_code == 400
    assert client.get("/api/runs?limit=0").status_code == 400
    assert client.get("/api/runs?limit=5").status_code == 200


def test_create_run_commits_then_enqueues(client, redis_db):
    resp = client.post("/api/runs", json={**SIM, "kind": "eval", "group_size": 2})
    assert resp.status_code == 202
    run = resp.get_json()
    assert resp.headers["Location"].endswith(f"/api/runs/{run['id']}")
    assert run["status"] == "queued" and run["priority"] == 5  # eval runs default to a higher priority
    assert run["config"]["group_size"] == 2 and run["config"]["scheduling"]["rollout_slots"] == 4
    # The control task is waiting on the real broker (the control queue, priority lists included).
    queued = [k.decode() for k in redis_db.keys("control*")]
    payloads = [m for k in queued for m in redis_db.lrange(k, 0, -1)]
    assert any(json.loads(p)["headers"]["task"] == "control.start_run" for p in payloads), queued
    got = client.get(f"/api/runs/{run['id']}").get_json()
    assert got["id"] == run["id"] and got["steps"] == [] and got["live"]["completions"] == 0
    listed = client.get("/api/runs").get_json()["runs"]
    assert [r["id"] for r in listed] == [run["id"]]


def _sent(redis_db, task: str) -> list[list]:
    """Args of every `task` message waiting on the control queues of the real broker."""
    payloads = [m for k in redis_db.keys("control*") for m in redis_db.lrange(k, 0, -1)]
    return [json.loads(base64.b64decode(json.loads(p)["body"]))[0] for p in payloads
            if json.loads(p)["headers"]["task"] == task]


def test_cancel_and_not_found(client, redis_db):
    assert client.get("/api/runs/999").status_code == 404
    assert client.post("/api/runs/999/cancel").status_code == 404
    # A queued run (no control worker took it) ends at once: nothing of it runs anywhere.
    queued = client.post("/api/runs", json=SIM).get_json()["id"]
    resp = client.post(f"/api/runs/{queued}/cancel")
    assert resp.status_code == 202 and resp.get_json()["status"] == "cancelled"
    with session_scope() as s:
        assert s.get(Run, queued).status == "cancelled" and s.get(Run, queued).finished_at is not None
    assert _sent(redis_db, "control.cancel_run") == []
    assert client.post(f"/api/runs/{queued}/cancel").status_code == 409
    # A started run is stopped by the control worker: cancelling, and the cancel task is sent.
    running = client.post("/api/runs", json=SIM).get_json()["id"]
    with session_scope() as s:
        s.get(Run, running).status = "running"
    resp = client.post(f"/api/runs/{running}/cancel")
    assert resp.status_code == 202 and resp.get_json()["status"] == "cancelling"
    assert _sent(redis_db, "control.cancel_run") == [[running]]


def test_a_run_no_control_worker_takes_says_so(client, monkeypatch):
    from app import config

    monkeypatch.setenv("TURNSTILE_LEASE_TTL_S", "2")
    monkeypatch.setenv("TURNSTILE_WATCHDOG_INTERVAL_S", "3")
    config.reset_settings()
    run_id = client.post("/api/runs", json=SIM).get_json()["id"]
    assert client.get(f"/api/runs/{run_id}").get_json()["waiting"] is None  # just created: not late yet
    with session_scope() as s:
        s.get(Run, run_id).created_at = utcnow() - dt.timedelta(seconds=6)  # past 2 s lease + 3 s watchdog
    waiting = client.get(f"/api/runs/{run_id}").get_json()["waiting"]
    assert waiting.startswith("no control worker has taken this run in 6 s") and "2 s lease" in waiting
    assert "3 s watchdog" in waiting and f"turnstile cancel {run_id}" in waiting
    with session_scope() as s:
        s.get(Run, run_id).status = "running"
    assert client.get(f"/api/runs/{run_id}").get_json()["waiting"] is None
    monkeypatch.undo()
    config.reset_settings()


def test_episode_with_completions_and_export(client):
    with session_scope() as s:
        run = Run(kind="collect", config={"harness": "mini-swe-agent", "model": {"name": "tiny"}})
        inst = TaskInstance(task_set="t", instance_id="demo-1", repo="r", record={})
        s.add_all([run, inst])
        s.flush()
        ep = Episode(run_id=run.id, instance_id=inst.id, group_index=0, sample_index=0, status="completed", reward=1.0)
        s.add(ep)
        s.flush()
        s.add(Completion(episode_id=ep.id, seq=0, request_key="a", api="chat", raw_request={"messages": []},
                         normalized_request={"messages": [{"role": "user", "content": "hi"}]},
                         prompt_ids=[1, 2, 3], sampled_ids=[4, 5], logprobs=[-0.5, -0.25], finish_reason="stop"))
        run_id, ep_id = run.id, ep.id
    body = client.get(f"/api/episodes/{ep_id}").get_json()
    assert body["instance_id"] == "demo-1" and body["reward"] == 1.0
    assert body["completions"][0]["sampled_ids"] == [4, 5] and body["completions"][0]["logprobs"] == [-0.5, -0.25]
    assert [e["id"] for e in client.get(f"/api/runs/{run_id}/episodes").get_json()["episodes"]] == [ep_id]
    lines = client.get(f"/api/runs/{run_id}/export").get_data(as_text=True).splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["completions"][0]["prompt_ids"] == [1, 2, 3]
    assert record["messages"][0] == {"role": "user", "content": "hi"}
    from app.engines.modeling import load_tokenizer

    # the final answer is the policy's own sampled ids decoded, token-exact
    assert record["messages"][-1] == {"role": "assistant", "content": load_tokenizer().decode([4, 5], skip_special_tokens=False)}


def test_export_decodes_with_the_tokenizer_alone_and_streams(client):
    """A fresh API process exports a smollm2 run without importing torch or transformers, and the
    answer is a stream (one line per episode, produced as read), not a body built in memory."""
    from app.api.tokenizer import smollm2_tokenizer

    smollm2_tokenizer()  # the cache the engine (or `turnstile model warm`) writes; built here if absent
    with session_scope() as s:
        run = Run(kind="collect", config={"harness": "mini-swe-agent", "model": {"name": "smollm2"}})
        inst = TaskInstance(task_set="t", instance_id="demo-1", repo="r", record={})
        s.add_all([run, inst])
        s.flush()
        for k in range(2):
            ep = Episode(run_id=run.id, instance_id=inst.id, group_index=0, sample_index=k, status="completed")
            s.add(ep)
            s.flush()
            s.add(Completion(episode_id=ep.id, seq=0, request_key=f"k{k}", api="chat", raw_request={"messages": []},
                             normalized_request={"messages": [{"role": "user", "content": "hi"}]},
                             prompt_ids=[1, 2], sampled_ids=[28120, 2], logprobs=[-0.1, -0.2], finish_reason="stop"))
        run_id = run.id
    code = (
        "import json, sys\n"
        "from app import create_app\n"
        "from support import api_client\n"
        f"resp = api_client(create_app({{'TESTING': True}})).get('/api/runs/{run_id}/export', buffered=False)\n"
        "streamed = resp.is_streamed\n"
        "lines = [json.loads(x) for x in resp.get_data(as_text=True).splitlines()]\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "print(json.dumps({'streamed': streamed, 'answers': [r['messages'][-1] for r in lines], 'heavy': heavy}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["heavy"] == [] and out["streamed"] is True
    text = smollm2_tokenizer().decode([28120, 2], skip_special_tokens=False)
    assert out["answers"] == [{"role": "assistant", "content": text}] * 2 and text.endswith("<|im_end|>")


def test_openapi_documents_every_route(client):
    spec = client.get("/api/openapi.json").get_json()
    assert spec["openapi"].startswith("3.")
    documented = set(spec["paths"])
    app = client.application
    routes = {r.rule.replace("<id:", "{").replace(">", "}") for r in app.url_map.iter_rules() if r.rule.startswith("/api/")}
    assert routes <= documented, routes - documented
    props = spec["components"]["schemas"]["RunConfig"]["properties"]
    assert {"task_set", "harness", "model", "group_size", "tasks_per_step", "steps", "timeouts", "mode"} <= set(props)


def test_responses_carry_exactly_the_documented_fields_in_order(client):
    """Bodies are built through the response models the OpenAPI document is generated from:
    every field of a real run, episode and completion is documented, none is missing, and the
    JSON keeps the documented order (no alphabetical re-sorting)."""
    with session_scope() as s:
        run = Run(kind="collect", config={"harness": "mini-swe-agent"})
        inst = TaskInstance(task_set="t", instance_id="demo-1", repo="r", record={})
        s.add_all([run, inst])
        s.flush()
        ep = Episode(run_id=run.id, instance_id=inst.id, group_index=0, sample_index=0, status="completed")
        s.add(ep)
        s.flush()
        s.add(Completion(episode_id=ep.id, seq=0, request_key="a", api="chat", raw_request={},
                         prompt_ids=[1], sampled_ids=[2], logprobs=[-0.1]))
        run_id, ep_id = run.id, ep.id
    spec = client.get("/api/openapi.json").get_json()
    schemas = spec["components"]["schemas"]
    assert "/api/health" in spec["paths"] and client.get("/api/health").get_json() == {"status": "ok"}
    checks = [(client.get(f"/api/runs/{run_id}").get_data(as_text=True), "Run"),
              (client.get(f"/api/episodes/{ep_id}").get_data(as_text=True), "Episode")]
    for raw, name in checks:
        body = json.loads(raw)
        assert list(body) == list(schemas[name]["properties"]), name  # same fields, same order
    episode = json.loads(checks[1][0])
    assert list(episode["completions"][0]) == list(schemas["Completion"]["properties"])
    listed = client.get("/api/runs").get_json()["runs"][0]
    assert list(listed) == list(schemas["Run"]["properties"]) and listed["live"]["graded"] == 1
    assert schemas["Run"]["properties"]["config"] == {"$ref": "#/components/schemas/RunConfig"}


@pytest.fixture
def any_client(any_database, redis_db):
    return api_client(create_app({"TESTING": True}))


@pytest.mark.parametrize("path", ["/api/runs/2147483648", "/api/runs/99999999999999999999/episodes",
                                  "/api/episodes/2147483648", "/api/runs/0", "/runs/2147483648",
                                  "/episodes/18446744073709551616"])
def test_ids_beyond_sql_integer_are_404_on_both_databases(any_client, path):
    resp = any_client.get(path)
    assert resp.status_code == 404


def test_malformed_query_and_deep_bodies_are_400_not_500(any_client):
    with session_scope() as s:
        run = Run(kind="eval", config={})
        s.add(run)
        s.flush()
        run_id = run.id
    resp = any_client.get(f"/api/runs/{run_id}/episodes?status=%00")
    assert resp.status_code == 400 and resp.get_json()["error"]["field"] == "status"
    deep = "[" * 5000 + "]" * 5000
    for body in ('{"training": ' + deep + "}", deep):
        resp = any_client.post("/api/runs", data=body, content_type="application/json")
        assert resp.status_code == 400, resp.get_data(as_text=True)[:200]
        assert "nested too deeply" in resp.get_json()["error"]["message"]
