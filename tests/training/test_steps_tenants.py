"""Two LoRA train runs on one trainer through `train_step` (SQLite, checkpoints, engine sync):
identical data and seeds give identical steps while interleaved, each run's adapter reaches the
engines under its own content-hashed name (the base weights are never pushed), and the gateway
maps each run's sessions to its newest adapter."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from sqlalchemy import select

from app.db import session_scope
from app.engines.lora_format import content_hash
from app.proxy.sessions import current_adapter
from app.tables import Run, TrainingStep
from app.training import steps


class AdapterEngine:
    """Records `POST /v1/load_lora_adapter` and `POST /v1/load_weights` bodies; answers 200.
    `GET /v1/lora_adapters` lists the adapters loaded since `forget()` (an engine restart);
    `GET /v1/policy_version` names the weights last loaded (`"tiny"` after a start or `forget()`)."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.since = 0
        self.weights = "tiny"
        self.refuse_weights = False  # answer 400 to POST /v1/load_weights
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                names = [b["lora_name"] for p, b in engine.calls[engine.since:] if p == "/v1/load_lora_adapter"]
                if self.path == "/v1/policy_version":
                    out = json.dumps({"policy_version": 0, "weights": engine.weights}).encode()
                else:
                    out = json.dumps({"object": "list", "data": [{"id": n} for n in names]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.calls.append((self.path, body))
                status = 200
                if self.path == "/v1/load_weights" and engine.refuse_weights:
                    status = 400
                elif self.path == "/v1/load_weights":
                    engine.weights = body.get("weights") or body.get("path")
                out = json.dumps({"policy_version": body.get("policy_version"), "lora_name": body.get("lora_name")})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out.encode())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def forget(self):
        self.since = len(self.calls)
        self.weights = "tiny"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def adapter_engine():
    server = AdapterEngine()
    yield server
    server.close()


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


LORA = {"lora": True, "lora_r": 4, "lora_alpha": 8, "learning_rate": 1e-2, "seed": 5}


def test_interleaved_lora_runs_train_alike_and_serve_their_own_adapters(var_dir, adapter_engine, data):
    a, b = data.run([adapter_engine.url], LORA), data.run([adapter_engine.url], LORA)
    episodes = {run: [data.group(run, g, [1.0, 0.0], seed=g + 1) for g in range(2)] for run in (a, b)}
    results = {a: [], b: []}
    for step in range(2):
        for run in (a, b):
            results[run].append(steps.train_step(run, step, episodes[run][step]))
    for ma, mb in zip(results[a], results[b]):
        assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"] and ma["grad_norm"] > 0
    assert steps._RESIDENT.pool is not None and set(steps._RESIDENT.pool.tenants) == {a, b}
    paths = [path for path, _body in adapter_engine.calls]
    assert paths == ["/v1/load_lora_adapter"] * 4  # never the full weights: the base stays shared
    names = [body["lora_name"] for _path, body in adapter_engine.calls]
    assert names[0].startswith(f"run-{a}@") and names[1].startswith(f"run-{b}@")
    assert names[0].split("@")[1] == names[1].split("@")[1]  # equal training, equal content
    assert names[0] != names[2]  # each version is a new name
    assert [body["policy_version"] for _p, body in adapter_engine.calls] == [1, 1, 2, 2]
    last = results[a][-1]
    assert last["adapter"] == names[2] and last["engine_sync"] == {adapter_engine.url: "ok"}
    folder = adapter_engine.calls[2][1]["lora_path"]
    assert names[2].endswith(content_hash(folder)[:12])
    with session_scope() as s:
        configs = {run: s.get(Run, run).config for run in (a, b)}
    configs = {run: {**cfg, "kind": "train"} for run, cfg in configs.items()}
    assert current_adapter(a, configs[a]) == names[2] and current_adapter(b, configs[b]) == names[3]
    # a held-out eval of run a samples a's newest adapter, not the shared base
    with session_scope() as s:
        s.get(Run, a).config = configs[a]
    assert current_adapter(10_000, {"kind": "eval", "eval_of": {"run": a, "step": 1}}) == names[2]
    assert current_adapter(10_000, {"kind": "eval"}) is None


def test_a_failed_step_of_one_run_leaves_the_other_runs_adapter(var_dir, adapter_engine, data):
    a, b = data.run([adapter_engine.url], LORA), data.run([adapter_engine.url], LORA)
    ea, eb = data.group(a, 0, [1.0, 0.0], seed=1), data.group(b, 0, [1.0, 0.0], seed=1)
    first_b = steps.train_step(b, 0, eb)
    parked = {k: v.clone() for k, v in steps._RESIDENT.pool.tenants[b].adapter.items()}
    with pytest.raises(LookupError):
        steps.train_step(a, 0, ea + [10_000])  # an episode that does not exist: A's step fails
    assert b in steps._RESIDENT.pool.tenants and a not in steps._RESIDENT.pool.tenants
    assert all(torch.equal(v, steps._RESIDENT.pool.tenants[b].adapter[k]) for k, v in parked.items())
    eb1 = data.group(b, 1, [1.0, 0.0], seed=2)
    assert steps.train_step(b, 1, eb1)["policy_version"] == first_b["policy_version"] + 1


def test_cancelling_one_run_drops_its_tenant_only(var_dir, adapter_engine, data):
    a, b = data.run([adapter_engine.url], LORA), data.run([adapter_engine.url], LORA)
    ea, eb = data.group(a, 0, [1.0, 0.0], seed=1), data.group(b, 0, [1.0, 0.0], seed=1)
    steps.train_step(a, 0, ea)
    steps.train_step(b, 0, eb)  # b is active, a parked
    with session_scope() as s:
        s.get(Run, a).status = "cancelled"
    ea1 = data.group(a, 1, [1.0, 0.0], seed=2)
    assert "skipped" in steps.train_step(a, 1, ea1)
    pool = steps._RESIDENT.pool
    assert a not in pool.tenants and pool.active == b
    installed = {k: p.data.clone() for k, p in pool.params.items()}  # b's adapter, untouched by a's cancel
    assert all(torch.equal(installed[k], v) for k, v in pool.tenants[b].adapter.items())
    eb1 = data.group(b, 1, [1.0, 0.0], seed=2)
    assert steps.train_step(b, 1, eb1)["policy_version"] == 2
    assert any(not torch.equal(installed[k], p.data) for k, p in pool.params.items())  # b trained on


def test_the_watchdog_reloads_a_restarted_engines_adapter_and_never_pushes_the_base(var_dir, adapter_engine, data):
    from app.control import engine_resync

    a = data.run([adapter_engine.url], LORA)
    name = steps.train_step(a, 0, data.group(a, 0, [1.0, 0.0], seed=1))["adapter"]
    assert engine_resync.resync_engines() == {}  # the engine serves it: nothing to do
    adapter_engine.forget()  # the engine restarted: no adapters
    assert engine_resync.resync_engines() == {adapter_engine.url: "ok"}
    assert adapter_engine.calls[-1][0] == "/v1/load_lora_adapter" and adapter_engine.calls[-1][1]["lora_name"] == name
    assert all(path != "/v1/load_weights" for path, _body in adapter_engine.calls)


def test_a_lora_step_puts_a_restarted_engine_back_on_the_runs_start_before_its_adapter(var_dir, adapter_engine,
                                                                                       data, tmp_path):
    """A warm-started LoRA run's adapter is trained on the starting checkpoint: an engine restarted
    since (serving its own base) gets that checkpoint, as version 0, before the step's adapter."""
    from app.engines.client import weights_label
    from app.engines.modeling import build_tiny_model, save_weights

    warm = save_weights(build_tiny_model(seed=3), tmp_path / "warm")
    a = data.run([adapter_engine.url], LORA)
    with session_scope() as s:
        s.get(Run, a).summary = {"start_weights": {"path": weights_label(warm), "policy_version": 0}}
    adapter_engine.weights = weights_label(warm)  # as the run's start left it
    steps.train_step(a, 0, data.group(a, 0, [1.0, 0.0], seed=1))
    assert [path for path, _body in adapter_engine.calls] == ["/v1/load_lora_adapter"]  # its base is in place
    adapter_engine.forget()  # the engine restarted on its own base
    metrics = steps.train_step(a, 1, data.group(a, 1, [1.0, 0.0], seed=2))
    assert metrics["engine_sync"] == {adapter_engine.url: "ok"}
    (base_path, base), (adapter_path, adapter) = adapter_engine.calls[adapter_engine.since:]
    assert (base_path, base["path"], base["policy_version"], base["weights"]) == (
        "/v1/load_weights", str(warm), 0, weights_label(warm))
    assert adapter_path == "/v1/load_lora_adapter" and adapter["lora_name"] == metrics["adapter"]
    adapter_engine.forget()  # restarted again, and now it refuses the base: no adapter goes on the wrong one
    adapter_engine.refuse_weights = True
    with pytest.raises(steps.WeightSyncError, match=f"^weight sync failed: {adapter_engine.url}: "):
        steps.train_step(a, 2, data.group(a, 2, [1.0, 0.0], seed=3))  # the step fails by name
    with session_scope() as s:
        row = s.scalar(select(TrainingStep).where(TrainingStep.run_id == a, TrainingStep.step == 2))
        assert row.status == "failed" and row.metrics["engine_sync_failed"] == [adapter_engine.url]
    assert [path for path, _body in adapter_engine.calls[adapter_engine.since:]] == ["/v1/load_weights"]


def test_steps_that_leave_the_adapter_unchanged_still_move_the_served_version(var_dir, data):
    """Every reward equal, so every advantage 0: the adapter's content, and so its name, is the same
    after each step, and the real embedded engine must still stamp answers with the newest step's
    version.  Stamped with the first one, every later group of the run read as served by an old
    policy, was dropped as stale, and the run stalled with its rollouts going on."""
    import httpx
    from werkzeug.serving import make_server

    from app.auth import auth_header
    from app.engines.embedded.engine import build_engine
    from app.engines.embedded.server import create_engine_app

    engine = build_engine("tiny", threads=1)
    server = make_server("127.0.0.1", 0, create_engine_app(engine=engine), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        run = data.run([url], LORA)
        results = [steps.train_step(run, step, data.group(run, step, [0.0, 0.0], seed=step + 1)) for step in range(3)]
        assert [r["policy_version"] for r in results] == [1, 2, 3]
        assert len({r["adapter"] for r in results}) == 1  # nothing trained: one content, one name
        assert all(r["engine_sync"] == {url: "ok"} for r in results)
        body = {"prompt": [5, 17, 300, 42], "max_tokens": 2, "temperature": 0, "model": results[-1]["adapter"]}
        with httpx.Client(base_url=url, timeout=60, headers=auth_header()) as http:
            answer = http.post("/v1/completions", json=body).raise_for_status().json()
        assert answer["policy_version"] == 3
    finally:
        server.shutdown()
        engine.scheduler.stop()
