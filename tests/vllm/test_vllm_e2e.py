"""The pipeline end to end on the real vLLM server (CPU build) instead of the embedded engine:
REST run -> Celery workers -> mini-swe-agent in its sandbox -> gateway -> vLLM (SmolLM2) ->
grading -> GRPO step on the gpu queue -> checkpoint -> weight sync through ``VLLMReloader``;
then an eval run of that checkpoint, loaded into vLLM the same way.

The session's vLLM server (``vllm_server``) is reused; no embedded engine runs here.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest
import redis
import torch
from alembic import command
from alembic.config import Config
from sqlalchemy import select

from app import config, db
from app.db import session_scope
from app.engines.modeling import load_model, load_weights_into
from app.engines.vllm import VLLMReloader
from app.harnesses import get_preset
from app.tables import Completion, Episode, TrainingStep
from support import AUTH, REDIS_BASE, ROOT, celery_worker_args, free_port, wait_for

pytestmark = pytest.mark.slow

E2E_REDIS_DB = 7


@pytest.fixture
def vllm_stack(tmp_path, monkeypatch, spawn, vllm_server):
    """API, gateway and Celery workers (control/prepare/grade, rollout, gpu) whose engine is the
    session's vLLM server; a fresh SQLite database, run outputs in a temporary var folder."""
    redis.Redis.from_url(f"{REDIS_BASE}/{E2E_REDIS_DB}").flushdb()
    var = tmp_path / "var"
    var.mkdir()
    project_var = ROOT / "var"
    (var / "models").symlink_to(project_var / "models")
    api_port, gw_port = free_port(), free_port()
    env = {
        "DATABASE_URL": f"sqlite:///{tmp_path / 'turnstile.db'}",
        "REDIS_URL": f"{REDIS_BASE}/{E2E_REDIS_DB}",
        "TURNSTILE_VAR_DIR": str(var),
        "TURNSTILE_CACHE_DIR": str(project_var / "cache"),
        "TURNSTILE_TOOLS_DIR": str(project_var / "tools"),
        "TURNSTILE_API_URL": f"http://127.0.0.1:{api_port}",
        "TURNSTILE_API_BIND": f"127.0.0.1:{api_port}",
        "TURNSTILE_GATEWAY_URL": f"http://127.0.0.1:{gw_port}",
        "TURNSTILE_GATEWAY_BIND": f"127.0.0.1:{gw_port}",
        "TURNSTILE_ENGINE_URLS": vllm_server.url,
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config.reset_settings()
    db.dispose_engine()
    command.upgrade(Config(str(ROOT / "alembic.ini")), "head")
    bin_dir = os.path.dirname(sys.executable)
    procs = {
        "gateway": spawn([f"{bin_dir}/gunicorn", "-c", "workers/gateway_conf.py", "app.proxy:create_gateway_app()"], env, "gateway"),
        "api": spawn([f"{bin_dir}/gunicorn", "-c", "workers/api_conf.py", "app:create_app()"], env, "api"),
        "cpu": spawn(celery_worker_args("control,prepare,grade", concurrency=2, name="cpu"), env, "cpu"),
        "rollout": spawn(celery_worker_args("rollout", concurrency=2, name="rollout"), env, "rollout"),
        "gpu": spawn(celery_worker_args("gpu", concurrency=1, name="gpu"), env, "gpu"),
    }
    api = httpx.Client(base_url=env["TURNSTILE_API_URL"], timeout=30, headers=AUTH)

    def logs() -> str:
        return "\n".join(f"===== {name}\n{p.output()[-3000:]}" for name, p in procs.items()) + \
            f"\n===== vllm\n{vllm_server.log_tail(3000)}"

    def up():
        try:
            return all(httpx.get(u, timeout=2).status_code == 200 for u in (
                f"{env['TURNSTILE_API_URL']}/api/health", f"{env['TURNSTILE_GATEWAY_URL']}/health"))
        except httpx.HTTPError:
            return False

    wait_for(up, 120, interval=0.5, what="the API and gateway to come up")
    yield api, logs
    api.close()
    db.dispose_engine()
    config.reset_settings()


def _finish(api, logs, run_id: int, timeout: float) -> dict:
    def done():
        run = api.get(f"/api/runs/{run_id}").json()
        return run if run["status"] in ("completed", "failed", "cancelled") else None

    return wait_for(done, timeout, interval=1, what=f"run {run_id} to finish\n{logs()}")


@pytest.mark.vllm_alone
def test_mini_swe_agent_train_step_reloads_vllm_then_eval_of_the_checkpoint(vllm_stack, vllm_server):
    api, logs = vllm_stack
    if not get_preset("mini-swe-agent").is_installed():
        pytest.fail("mini-swe-agent is not installed: run `make ci-deps`")
    model = {"name": "smollm2", "engine": "vllm", "engine_urls": [vllm_server.url]}
    train = {"kind": "train", "harness": "mini-swe-agent", "task_set": "synthetic",
             "instances": ["synthetic__inflection-1"], "model": model, "group_size": 2, "tasks_per_step": 1,
             "steps": 1, "budget": {"max_turns": 2, "max_tokens": 24}, "timeouts": {"agent_s": 300, "grade_s": 300}}
    resp = api.post("/api/runs", json=train)
    assert resp.status_code == 202, resp.text
    run = _finish(api, logs, resp.json()["id"], 900)
    assert run["status"] == "completed", (run["error"], logs())
    with session_scope() as s:
        step = s.scalars(select(TrainingStep).where(TrainingStep.run_id == run["id"])).one()
        comps = s.scalars(select(Completion).join(Episode).where(Episode.run_id == run["id"])).all()
        assert comps and {c.api for c in comps} == {"chat"}
        for c in comps:
            assert c.prompt_ids and c.sampled_ids and len(c.sampled_ids) == len(c.logprobs) and not c.partial
        # History splicing reaching vLLM: a spliced call's recorded prompt (vLLM's own prompt ids)
        # is exactly the spliced prompt the gateway sent, not a re-rendering of the messages.
        for c in comps:
            if "prompt_tokens" in (c.raw_request.get("splice") or {}):
                assert len(c.prompt_ids) == c.raw_request["splice"]["prompt_tokens"], c.raw_request["splice"]
        m = step.metrics
        checkpoint = Path(step.checkpoint_path) / "model"
    print(f"\nvLLM e2e train step: logprob gap trainer vs vLLM max {m['logprob_gap_max_abs']:.2e}, "
          f"mean {m['logprob_gap_mean_abs']:.2e}; engine sync {m['engine_sync']} in {m['engine_sync_time_s']:.1f} s")
    assert step.status == "completed" and m["tokens_trained"] > 0
    assert m["engine_sync"] == {vllm_server.url: "ok"}, m["engine_sync"]
    assert m["logprob_gap_max_abs"] < 1e-3, m   # trainer recomputation vs the logprobs vLLM recorded

    # vLLM now serves the step's weights: its logprobs follow the checkpoint.  (SmolLM2 earns
    # reward 0 on both episodes, so the GRPO advantage and the update are zero and the checkpoint
    # equals the base weights; tests/vllm/test_vllm_contract.py proves a reload to different
    # weights is followed.)
    trained, _ = load_model("smollm2")
    load_weights_into(trained, checkpoint)
    trained.eval()
    messages = [{"role": "user", "content": "Fix the failing test."}]
    out = vllm_server.client.chat(messages, model="policy", max_tokens=12, seed=1, logprobs=True,
                                  return_token_ids=True, ignore_eos=True)
    prompt_ids, ids = out["prompt_token_ids"], out["choices"][0]["token_ids"]
    with torch.no_grad():
        logits = trained(torch.tensor([prompt_ids + ids])).logits[0]
    recomputed = torch.log_softmax(logits, -1)[len(prompt_ids) - 1:-1].gather(1, torch.tensor(ids)[:, None])[:, 0]
    served = torch.tensor([e["logprob"] for e in out["choices"][0]["logprobs"]["content"]])
    assert (recomputed - served).abs().max().item() < 1e-3

    # An eval run of that checkpoint: loaded into vLLM through the reloader again, every call
    # answered and recorded as policy version 1.
    evaluation = {**train, "kind": "eval", "group_size": 1, "budget": {"max_turns": 1, "max_tokens": 24},
                  "model": {**model, "checkpoint": f"run:{run['id']}"}}
    resp = api.post("/api/runs", json=evaluation)
    assert resp.status_code == 202, resp.text
    ev = _finish(api, logs, resp.json()["id"], 600)
    assert ev["status"] == "completed" and ev["policy_version"] == 1, (ev["error"], logs())
    with session_scope() as s:
        versions = {c.policy_version for c in s.scalars(select(Completion).join(Episode).where(Episode.run_id == ev["id"]))}
    assert versions == {1}

    reloader = VLLMReloader(vllm_server.url)   # leave the shared server on the base weights
    try:
        reloader.reload(str(vllm_server.model_dir), 0)
    finally:
        reloader.close()
