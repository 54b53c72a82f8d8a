"""The unmodified tinker SDK (tinker.ServiceClient) against a real Tinker service process.

Futures are finished here through `app.control.tinker_futures`, as the gpu worker does: this file
tests the service (routes, wire formats, auth, quotas, futures), not the trainer's numbers.
"""
from __future__ import annotations

import datetime as dt
import threading
import time
import uuid

import httpx
import pytest
import tinker
from sqlalchemy import func, select
from tinker import types

from app.control import tinker_futures
from app.db import session_scope
from app.tables import Run, TinkerFuture, TinkerModel
from support import wait_for

TINKER_REDIS_DB = 8  # its own broker DB: the end-to-end tests' workers (DB 12) must not take its messages
SDK_HEADERS = {"X-Stainless-Package-Version": tinker.__version__, "Content-Type": "application/json"}


def _client(url: str, api_key: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=url, api_key=api_key)


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64",
                                                                         shape=[len(tokens) - 1]),
                                       "weights": types.TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32",
                                                                   shape=[len(tokens) - 1])})


def _futures(**where) -> list[TinkerFuture]:
    with session_scope() as s:
        rows = s.scalars(select(TinkerFuture).filter_by(**where).order_by(TinkerFuture.id)).all()
        for row in rows:
            s.expunge(row)
        return rows


def _finish_when_pending(op: str, result: dict) -> threading.Thread:
    """Complete the next `op` future once it is pending (as the gpu worker would: claim, then complete)."""
    def run() -> None:
        row = wait_for(lambda: next(iter(_futures(op=op, status="pending")), None), 30, what=f"a pending {op}")
        time.sleep(0.5)  # the SDK's first polls see it pending (try_again)
        with session_scope() as s:
            claimed = tinker_futures.claim(s, row.id, lease_s=30)
            tinker_futures.complete(s, claimed.id, result, attempt=claimed.attempts)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_session_capabilities_model_and_info(tinker_url, key):
    sc = _client(tinker_url, key("alice"))
    names = [m.model_name for m in sc.get_server_capabilities().supported_models]
    assert names == ["smollm2", "tiny", "HuggingFaceTB/SmolLM2-135M-Instruct"]  # SmolLM2 by its Hub id too
    tc = sc.create_lora_training_client(base_model="tiny", rank=8, seed=3).result(timeout=60)
    info = tc.get_info()
    assert (info.model_name, info.lora_rank, info.is_lora) == ("tiny", 8, True)
    with session_scope() as s:
        model = s.get(TinkerModel, info.model_id)
        run = s.get(Run, model.run_id)
        assert (run.kind, run.status, model.key_name) == ("tinker", "running", "alice")
        cfg = run.run_config()
        assert (cfg.kind, cfg.model.name, cfg.training.lora, cfg.training.lora_r, cfg.training.seed) == \
            ("tinker", "tiny", True, 8, 3)
    assert tc.get_tokenizer().encode("hi")  # the tokenizer folder get_info names loads offline


def test_forward_backward_is_pending_then_done(tinker_url, key):
    tc = _client(tinker_url, key("alice")).create_lora_training_client(base_model="tiny", rank=8).result(timeout=60)
    logprobs = [-1.25, -0.5, -2.0]
    result = {"loss_fn_output_type": "ArrayRecord", "metrics": {"loss:sum": 3.75},
              "loss_fn_outputs": [{"logprobs": {"data": logprobs, "dtype": "float32", "shape": [3]}}]}
    finisher = _finish_when_pending("forward_backward", result)
    future = tc.forward_backward([_datum([5, 6, 7, 8])], "cross_entropy")
    with pytest.raises(TimeoutError):
        future.result(timeout=0.2)  # still pending: the service answers try_again
    out = future.result(timeout=60)
    finisher.join(5)
    assert out.metrics == {"loss:sum": 3.75}
    assert out.loss_fn_outputs[0]["logprobs"].tolist() == logprobs
    (row,) = _futures(op="forward_backward")
    assert row.status == "completed" and row.attempts == 1
    # the protobuf body, zstd-compressed by the SDK, stored as the ForwardBackwardInput JSON
    assert row.payload["loss_fn"] == "cross_entropy"
    assert row.payload["data"][0]["model_input"]["chunks"][0]["tokens"] == [5, 6, 7]
    assert row.payload["data"][0]["loss_fn_inputs"]["target_tokens"]["data"] == [6, 7, 8]

    finisher = _finish_when_pending("optim_step", {"metrics": {"grad_norm": 0.5}})
    step = tc.optim_step(types.AdamParams(learning_rate=1e-3, beta1=0.8)).result(timeout=60)
    finisher.join(5)
    assert step.metrics == {"grad_norm": 0.5}
    (opt,) = _futures(op="optim_step")
    # the SDK's own JSON of OptimStepRequest names AdamParams "adam_params"
    assert opt.payload["adam_params"]["learning_rate"] == 1e-3 and opt.payload["adam_params"]["beta1"] == 0.8


def test_failed_future_raises_in_the_sdk(tinker_url, key):
    tc = _client(tinker_url, key("alice")).create_lora_training_client(base_model="tiny", rank=8).result(timeout=60)
    future = tc.forward([_datum([1, 2, 3])], "cross_entropy")
    row = wait_for(lambda: next(iter(_futures(op="forward")), None), 30, what="the forward future")
    with session_scope() as s:
        tinker_futures.fail(s, row.id, {"error": "the worker ran out of memory", "category": "Server"})
    with pytest.raises(tinker.RequestFailedError, match="ran out of memory"):
        future.result(timeout=60)


def test_same_request_id_twice_is_one_row(tinker_url, key):
    sc = _client(tinker_url, key("alice"))
    tc = sc.create_lora_training_client(base_model="tiny", rank=8).result(timeout=60)
    model_id = tc.get_info().model_id
    body = types.OptimStepRequest(optim_params=types.AdamParams(learning_rate=1e-4), model_id=model_id,
                                  seq_id=1).model_dump(mode="json")
    headers = {**SDK_HEADERS, "X-API-Key": key("alice"), "X-Idempotency-Key": f"stainless-python-retry-{uuid.uuid4()}"}
    first = httpx.post(f"{tinker_url}/api/v1/optim_step", json=body, headers=headers).json()
    again = httpx.post(f"{tinker_url}/api/v1/optim_step", json=body, headers=headers).json()
    assert first == again and first["request_id"] == headers["X-Idempotency-Key"]
    assert len(_futures(op="optim_step")) == 1


def test_bad_key_is_401(tinker_url, key):
    # a ServiceClient connects on first use (its session is made lazily)
    with pytest.raises(tinker.AuthenticationError, match="invalid or missing Tinker API key"):
        _client(tinker_url, key("alice")[:-4] + "AAAA").create_lora_training_client(base_model="tiny", rank=8).result(timeout=60)
    with pytest.raises(tinker.AuthenticationError):
        _client(tinker_url, "tml-carol-nothing").create_lora_training_client(base_model="tiny", rank=8).result(timeout=60)
    assert _futures() == []


def test_a_key_cannot_see_another_keys_model_or_future(tinker_url, key):
    tc = _client(tinker_url, key("alice")).create_lora_training_client(base_model="tiny", rank=8).result(timeout=60)
    model_id = tc.get_info().model_id
    future = tc.optim_step(types.AdamParams(learning_rate=1e-4))
    row = wait_for(lambda: next(iter(_futures(op="optim_step")), None), 30, what="the optim_step future")
    bob = {**SDK_HEADERS, "X-API-Key": key("bob")}
    info = httpx.post(f"{tinker_url}/api/v1/get_info", json={"model_id": model_id}, headers=bob)
    assert info.status_code == 404 and model_id in info.json()["detail"]
    poll = httpx.post(f"{tinker_url}/api/v1/retrieve_future", json={"request_id": row.request_id}, headers=bob)
    assert poll.status_code == 404
    step = httpx.post(f"{tinker_url}/api/v1/optim_step", headers=bob,
                      json={"optim_params": {"learning_rate": 1e-4}, "model_id": model_id})
    assert step.status_code == 404 and len(_futures(op="optim_step")) == 1
    with session_scope() as s:
        tinker_futures.complete(s, row.id, {"metrics": {}})
    assert future.result(timeout=30).metrics == {}


def test_malformed_bodies_are_400_and_leave_no_future(tinker_url, key):
    tc = _client(tinker_url, key("alice")).create_lora_training_client(base_model="tiny", rank=8).result(timeout=60)
    model_id = tc.get_info().model_id
    headers = {**SDK_HEADERS, "X-API-Key": key("alice")}
    proto = {**headers, "Content-Type": "application/x-protobuf"}
    garbage = httpx.post(f"{tinker_url}/api/v1/forward_backward", content=b"\xff\x01not a protobuf", headers=proto)
    assert garbage.status_code == 400 and "ForwardBackwardRequest" in garbage.json()["detail"]
    zstd = httpx.post(f"{tinker_url}/api/v1/forward_backward", content=b"\x00" * 16,
                      headers={**proto, "Content-Encoding": "zstd"})
    assert zstd.status_code == 400 and "zstd" in zstd.json()["detail"]
    broken = httpx.post(f"{tinker_url}/api/v1/optim_step", content=b'{"model_id": ', headers=headers)
    assert broken.status_code == 400 and "not JSON" in broken.json()["detail"]
    wrong = httpx.post(f"{tinker_url}/api/v1/optim_step", json={"model_id": model_id, "optim_params": 3},
                       headers=headers)
    assert wrong.status_code == 400 and "OptimStepRequest" in wrong.json()["detail"]
    assert garbage.headers["x-should-retry"] == "false"
    with session_scope() as s:
        assert s.scalar(select(func.count()).select_from(TinkerFuture).where(TinkerFuture.op != "create_model")) == 0


def test_unsupported_base_model_rank_and_loss_are_clear_errors(tinker_url, key):
    sc = _client(tinker_url, key("alice"))
    with pytest.raises(tinker.BadRequestError, match="base model 'Qwen/Qwen3-8B' is not served here; supported: "
                                                     "smollm2, tiny, HuggingFaceTB/SmolLM2-135M-Instruct"):
        sc.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="base model 'Qwen/Qwen3-8B' is not served here"):
        sc.create_sampling_client(base_model="Qwen/Qwen3-8B").result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="LoRA rank 3 is not allowed"):
        sc.create_lora_training_client(base_model="tiny", rank=3).result(timeout=60)
    tc = sc.create_lora_training_client(base_model="tiny", rank=8).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="loss function 'cispo' is not supported"):
        tc.forward_backward([_datum([1, 2, 3])], "cispo").result(timeout=60)
    assert _futures(op="forward_backward") == []


def test_quota_max_models(tinker_url, key):
    sc = _client(tinker_url, key("alice"))
    for _ in range(3):
        sc.create_lora_training_client(base_model="tiny", rank=4).result(timeout=60)
    with pytest.raises(tinker.PermissionDeniedError, match="max_models is 3"):
        sc.create_lora_training_client(base_model="tiny", rank=4).result(timeout=60)


def test_unsupported_sdk_version_is_a_clear_error(tinker_env, spawn, monkeypatch, key):
    monkeypatch.setenv("TURNSTILE_TINKER_SDK_VERSIONS", "0.37.0")
    url = _start(spawn, monkeypatch)
    with pytest.raises(tinker.BadRequestError, match=f"tinker SDK {tinker.__version__} is not supported"):
        _client(url, key("alice")).create_lora_training_client(base_model="tiny", rank=8).result(timeout=60)


def _start(spawn, monkeypatch) -> str:
    import os
    import sys

    from app import config
    from support import free_port

    port = free_port()
    monkeypatch.setenv("TURNSTILE_TINKER_BIND", f"127.0.0.1:{port}")
    config.reset_settings()
    proc = spawn([os.path.join(os.path.dirname(sys.executable), "gunicorn"), "-c", "workers/tinker_conf.py",
                  "app.tinker:create_tinker_app()"], name="tinker-old")
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, 60, what=lambda: proc.output()[-3000:])
    return url


def test_no_tenant_while_a_full_fine_tune_holds_the_engines(tinker_url, key):
    from app.runconfig import RunConfig

    with session_scope() as s:
        full = Run(kind="train", status="running", config=RunConfig(kind="train").model_dump(mode="json"))
        s.add(full)
        s.flush()
        full_id = full.id
    with pytest.raises(tinker.BadRequestError, match=f"train run {full_id} is a full fine-tune"):
        _client(tinker_url, key("alice")).create_lora_training_client(base_model="tiny", rank=8).result(timeout=60)
    with session_scope() as s:
        assert s.scalar(select(func.count()).select_from(TinkerModel)) == 0


def test_ops_are_sent_to_their_queues(tinker_url, key, tinker_redis):
    """Each gpu op's Celery message waits on the gpu queue, named for app.tasks.tinker.run_future."""
    import base64
    import json

    tc = _client(tinker_url, key("alice")).create_lora_training_client(base_model="tiny", rank=8).result(timeout=60)
    tc.optim_step(types.AdamParams(learning_rate=1e-4))
    (row,) = wait_for(lambda: _futures(op="optim_step"), 30, what="the optim_step future")
    messages = wait_for(lambda: tinker_redis.lrange("gpu", 0, -1), 10, what="a message on the gpu queue")
    (msg,) = [json.loads(m) for m in messages]
    assert msg["headers"]["task"] == "app.tasks.tinker.run_future"
    assert json.loads(base64.b64decode(msg["body"]))[0] == [row.id]


def test_sample_goes_to_the_rollout_queue_and_comes_back_as_protobuf(tinker_url, key, tinker_redis):
    import json

    sampler = _client(tinker_url, key("alice")).create_sampling_client(base_model="tiny")
    future = sampler.sample(prompt=types.ModelInput.from_ints([1, 2, 3]), num_samples=2,
                            sampling_params=types.SamplingParams(max_tokens=2, temperature=1.0),
                            include_prompt_logprobs=True)
    (row,) = wait_for(lambda: _futures(op="sample"), 30, what="the sample future")
    assert row.payload["num_samples"] == 2 and row.payload["prompt"]["chunks"][0]["tokens"] == [1, 2, 3]
    (msg,) = [json.loads(m) for m in wait_for(lambda: tinker_redis.lrange("rollout", 0, -1), 10,
                                              what=lambda: f"rollout: {tinker_redis.keys()} {_futures(op='sample')[0].error}")]
    assert msg["headers"]["task"] == "app.tasks.tinker_sample.sample_future"
    result = {"sequences": [{"stop_reason": "length", "tokens": [7, 8], "logprobs": [-0.5, -1.5]},
                            {"stop_reason": "stop", "tokens": [9], "logprobs": [-0.25]}],
              "prompt_logprobs": [None, -2.0, -3.0], "prompt_cache_hit_tokens": 0}
    with session_scope() as s:
        assert tinker_futures.complete(s, row.id, result)
    out = future.result(timeout=60)
    assert [(q.stop_reason, q.tokens, q.logprobs) for q in out.sequences] == \
        [("length", [7, 8], [-0.5, -1.5]), ("stop", [9], [-0.25])]
    assert [q.sequence_id for q in out.sequences] == [f"{row.request_id}:0", f"{row.request_id}:1"]
    assert out.prompt_logprobs == [None, -2.0, -3.0]


def test_pending_until_the_real_gpu_worker_runs_it(tinker_url, key, spawn):
    """The future waits (try_again) while no gpu worker serves the queue, and is done once one
    starts: the real worker (workers.gpu_worker) computes it on the tiny model's LoRA tenant."""
    import sys

    tc = _client(tinker_url, key("alice")).create_lora_training_client(base_model="tiny", rank=8).result(timeout=60)
    future = tc.forward_backward([_datum([5, 6, 7, 8])], "cross_entropy")
    (row,) = wait_for(lambda: _futures(op="forward_backward"), 30, what="the forward_backward future")
    with pytest.raises(TimeoutError):
        future.result(timeout=3)
    assert _futures(op="forward_backward")[0].status == "pending"
    gpu = spawn([sys.executable, "-m", "workers.gpu_worker", "--loglevel", "INFO", "-n", f"gpu-{uuid.uuid4().hex[:6]}@%h"],
                name="gpu")
    out = future.result(timeout=180)
    loss = [v for k, v in out.metrics.items() if k.startswith("loss")]
    assert loss and loss[0] > 0, (out.metrics, gpu.output()[-2000:])
    logprobs = out.loss_fn_outputs[0]["logprobs"].tolist()
    assert len(logprobs) == 3 and all(lp < 0 for lp in logprobs)
    step = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
    assert step is not None
    rows = _futures()
    assert [(r.op, r.status, r.attempts) for r in rows if r.op != "create_model"] == \
        [("forward_backward", "completed", 1), ("optim_step", "completed", 1)]


def test_an_ended_model_refuses_new_ops(tinker_url, key):
    from app.control import tinker_models
    from app.tables import TinkerSession, utcnow

    tc = _client(tinker_url, key("alice")).create_lora_training_client(base_model="tiny", rank=8).result(timeout=60)
    model_id = tc.get_info().model_id
    with session_scope() as s:  # as if the client had gone away an hour ago (one transaction: no heartbeat between)
        model = s.get(TinkerModel, model_id)
        s.get(TinkerSession, model.session_id).heartbeat_at = utcnow() - dt.timedelta(hours=1)
        s.flush()
        assert tinker_models.finish_idle(s, utcnow(), session_timeout_s=120) == [model.run_id]
    with pytest.raises(tinker.BadRequestError, match=f"model '{model_id}' has ended"):
        tc.optim_step(types.AdamParams(learning_rate=1e-4)).result(timeout=60)


def test_retrieve_futures_lists_a_sampling_sessions_finished_requests(tinker_url, key):
    sampler = _client(tinker_url, key("alice")).create_sampling_client(base_model="tiny").result(timeout=60)
    sampler.sample(prompt=types.ModelInput.from_ints([1, 2]), num_samples=1,
                   sampling_params=types.SamplingParams(max_tokens=1))
    (row,) = wait_for(lambda: _futures(op="sample"), 30, what="the sample future")
    headers = {**SDK_HEADERS, "X-API-Key": key("alice")}
    target = {"type": "sampling_session", "sampling_session_id": row.sampling_session_id}
    poll = lambda seen: httpx.post(f"{tinker_url}/api/v1/retrieve_futures", headers=headers,  # noqa: E731
                                   json={"target": target, "retrieved_request_ids": seen}).json()
    assert poll([])["completions"] == []
    with session_scope() as s:
        tinker_futures.fail(s, row.id, {"error": "engine gone", "category": "Server"})
    assert poll([])["completions"] == [{"state": "failed", "request_id": row.request_id}]
    assert poll([row.request_id])["completions"] == []
    other = httpx.post(f"{tinker_url}/api/v1/retrieve_futures", json={"target": target},
                       headers={**SDK_HEADERS, "X-API-Key": key("bob")})
    assert other.status_code == 404


def test_a_new_model_sets_aside_a_run_folder_another_database_left(tinker_url, key):
    """Run ids restart at 1 in every new database: a `runs/<id>/` holding another database's Tinker
    state (here a current.pt of another LoRA shape) is moved aside, never restored into this model."""
    from app.paths import RunPaths

    with session_scope() as s:
        next_id = (s.scalar(select(func.max(Run.id))) or 0) + 1
    stale = RunPaths(next_id).root
    (stale / "tinker").mkdir(parents=True, exist_ok=True)
    (stale / "run.json").write_text('{"database": "sqlite:///elsewhere.db", "created_at": "2026-01-01T00:00:00"}')
    (stale / "tinker" / "current.pt").write_bytes(b"another model's state")
    tc = _client(tinker_url, key("alice")).create_lora_training_client(base_model="tiny", rank=8).result(timeout=60)
    with session_scope() as s:
        assert s.get(TinkerModel, tc.get_info().model_id).run_id == next_id
    assert not (stale / "tinker" / "current.pt").exists()
    assert '"database": "sqlite:///elsewhere.db"' not in (stale / "run.json").read_text()
    # (earlier tests of this process may have set aside their own `runs/<id>/` folders too)
    aside = [p / "tinker" / "current.pt" for p in stale.parent.glob(f"{next_id}.stale-*")]
    assert [f.read_bytes() for f in aside if f.is_file()].count(b"another model's state") == 1


def test_smollm2_by_its_hub_id(tinker_url, key):
    """A base model named by its Hugging Face id (as Tinker's lineup and tinker-cookbook name
    models) is the built-in spec it names: the run trains and samples `smollm2`."""
    sc = _client(tinker_url, key("alice"))
    tc = sc.create_lora_training_client(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", rank=8).result(timeout=60)
    info = tc.get_info()
    with session_scope() as s:
        run = s.get(Run, s.get(TinkerModel, info.model_id).run_id)
        assert run.run_config().model.name == "smollm2"
    assert info.model_name == "smollm2"
    sc.create_sampling_client(base_model="HuggingFaceTB/SmolLM2-135M-Instruct").result(timeout=60)
    with session_scope() as s:
        from app.tables import TinkerSamplingSession
        assert s.scalars(select(TinkerSamplingSession.base_model)).all() == ["smollm2"]


def test_closing_the_client_finishes_its_session_and_ends_idle_models(tinker_url, key):
    """ServiceClient.close() sends `POST /sessions/<id>/finish`: the session stops counting toward
    `max_sessions` and its models end, at once when nothing of theirs is in flight, else once it is."""
    from app.control import tinker_models
    from app.tables import TinkerSession, utcnow

    sc = _client(tinker_url, key("alice"))
    idle = sc.create_lora_training_client(base_model="tiny", rank=8).result(timeout=60).get_info().model_id
    busy_tc = sc.create_lora_training_client(base_model="tiny", rank=8).result(timeout=60)
    busy = busy_tc.get_info().model_id
    busy_tc.forward_backward([_datum([1, 2, 3])], "cross_entropy")  # no gpu worker: stays pending
    wait_for(lambda: _futures(op="forward_backward"), 30, what="the forward_backward row")
    sc.close("success").result(timeout=60)
    with session_scope() as s:
        session = s.get(TinkerSession, s.get(TinkerModel, idle).session_id)
        assert (session.finish_reason, session.finished_at is not None) == ("success", True)
        runs = {m: s.get(Run, s.get(TinkerModel, m).run_id).status for m in (idle, busy)}
    assert runs == {idle: "completed", busy: "running"}
    row = _futures(op="forward_backward")[0]
    with session_scope() as s:  # the gpu worker finishes it; the next watchdog pass ends the model
        claimed = tinker_futures.claim(s, row.id, lease_s=30)
        tinker_futures.complete(s, claimed.id, {"loss_fn_outputs": [], "metrics": {}}, attempt=claimed.attempts)
    with session_scope() as s:
        assert tinker_models.finish_idle(s, utcnow(), session_timeout_s=3600) == [s.get(TinkerModel, busy).run_id]
    # The SDK's contract: a finished session rejects further operations.
    # (the closed SDK client sends nothing more: the request as it would send it)
    body = types.OptimStepRequest(model_id=busy, adam_params=types.AdamParams(learning_rate=1e-4), seq_id=9)
    refused = httpx.post(f"{tinker_url}/api/v1/optim_step", headers={**SDK_HEADERS, "X-API-Key": key("alice")},
                         content=body.model_dump_json(), timeout=30)
    assert refused.status_code == 400 and "was finished by its client (success)" in refused.text


def test_finish_is_once_per_session_and_the_keys_own(tinker_url, key):
    from app.tables import TinkerSession

    headers = {**SDK_HEADERS, "X-API-Key": key("alice")}
    session_id = httpx.post(f"{tinker_url}/api/v1/create_session", headers=headers, timeout=30,
                            json={"tags": [], "user_metadata": None, "sdk_version": tinker.__version__}).json()["session_id"]
    finish = f"{tinker_url}/api/v1/sessions/{session_id}/finish"
    bob = {**SDK_HEADERS, "X-API-Key": key("bob")}
    assert httpx.post(finish, headers=bob, json={"reason": {"type": "success"}}, timeout=30).status_code == 404
    bad = httpx.post(finish, headers=headers, json={"reason": {"type": "done"}}, timeout=30)
    assert bad.status_code == 400 and "'done' is not one of success, errored, interrupted" in bad.text
    assert httpx.post(finish, headers=headers, json={"reason": "success"}, timeout=30).status_code == 400
    first = httpx.post(finish, headers=headers, json={"reason": {"type": "errored"}, "detail": "KeyboardInterrupt"},
                       timeout=30)
    again = httpx.post(finish, headers=headers, json={"reason": {"type": "success"}, "detail": None}, timeout=30)
    assert (first.status_code, again.status_code) == (200, 200)
    with session_scope() as s:
        row = s.get(TinkerSession, session_id)
        assert (row.finish_reason, row.finish_detail) == ("errored", "KeyboardInterrupt")
