"""The gpu task of the Tinker ops (app.tasks.tinker.run_future) on real SQL futures and the tiny model.

In-process: each op's result equals the same op by app.training.tinker_ops on a pool of its own
(bit-equal: same process, same threads); a lost tenant (a fresh worker process) is restored
from its persisted state and the forward_backward futures since then are replayed, so the
optim_step after the loss equals one that never lost anything; a tenant another worker moved on
from is restored the same way; an optim_step whose worker died
after persisting finishes with its stored result and steps once; bad input fails the future
as the caller's error; a model's ops run in their futures' order.  Real worker: a `celery worker -Q gpu` SIGKILLed in the middle of a
forward_backward (a test-only delay after the gradients, before completion), restarted: the
future completes once (2 claims), and the optim_step after it applies the gradients once.
"""
from __future__ import annotations

import random
import uuid

import pytest
import torch
from sqlalchemy import select

from app import config as app_config
from app.control import tinker_futures
from app.db import session_scope
from app.runconfig import RunConfig
from app.tables import Run, TinkerFuture, TinkerModel, TinkerSession
from support import REDIS_BASE, celery_worker_args, wait_for

REDIS_DB = 14  # a broker database of this module's own: other tests' gpu messages stay off it
VOCAB = 49152  # the tiny spec's (SmolLM2's) vocabulary
ADAM = {"adam_params": {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12}}


@pytest.fixture
def var(database, monkeypatch, tmp_path):
    from app.training import tinker_ops

    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("TURNSTILE_TRAINER_THREADS", "1")
    app_config.reset_settings()
    tinker_ops.reset_resident()
    yield tmp_path / "var"
    tinker_ops.reset_resident()
    app_config.reset_settings()


def make_model(seed: int = 3) -> str:
    """A Tinker model (session, run of kind tinker on "tiny", LoRA r 4, model row); its id."""
    cfg = RunConfig.model_validate({"kind": "tinker", "model": {"name": "tiny"}, "steps": 0, "training": {
        "lora": True, "lora_r": 4, "seed": seed}})
    with session_scope() as s:
        session = TinkerSession(id=f"session-{uuid.uuid4()}", key_name="alice", sdk_version="0.38.0", tags=[],
                                user_metadata={})
        run = Run(kind="tinker", status="running", config=cfg.model_dump(mode="json"), name="tinker test")
        s.add_all([session, run])
        s.flush()
        s.add(TinkerModel(id=f"tinker-{run.id}", run_id=run.id, session_id=session.id, seq_id=0, key_name="alice",
                          base_model="tiny", lora_rank=4))
        return f"tinker-{run.id}"


def submit(model_id: str, op: str, payload: dict) -> int:
    with session_scope() as s:
        return tinker_futures.create(s, model_id=model_id, request_id=str(uuid.uuid4()), op=op, payload=payload,
                                     key_name="alice").id


def row(future_id: int) -> TinkerFuture:
    with session_scope() as s:
        out = s.get(TinkerFuture, future_id)
        s.expunge(out)
        return out


def batch(seed: int, loss_fn: str = "cross_entropy", n: int = 3, length: int = 12) -> dict:
    rng = random.Random(seed)
    data = []
    for _ in range(n):
        tokens = [rng.randrange(3, VOCAB) for _ in range(length + 1)]
        inputs = {"target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [length]}}
        if loss_fn == "cross_entropy":
            inputs["weights"] = {"data": [1.0] * length, "dtype": "float32", "shape": [length]}
        else:
            inputs["logprobs"] = {"data": [-10.8 + rng.random() for _ in range(length)], "dtype": "float32",
                                  "shape": [length]}
            inputs["advantages"] = {"data": [rng.choice((1.0, -1.0))] * length, "dtype": "float32",
                                    "shape": [length]}
        data.append({"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
                     "loss_fn_inputs": inputs})
    return {"data": data, "loss_fn": loss_fn, "loss_fn_config": None}


def run(model_id: str, op: str, payload: dict) -> dict:
    """Submit and run one op in this process (the task body, as the worker calls it); its result."""
    from app.tasks.tinker import run_future

    future_id = submit(model_id, op, payload)
    assert run_future(future_id) == "completed", row(future_id).error
    return row(future_id).result


class Direct:
    """The same ops by app.training.tinker_ops on a pool of its own (the uninterrupted reference)."""

    def __init__(self, seed: int = 3):
        from app.training import tinker_ops
        from app.training.tenants import TenantPool
        from app.training.trainer import Trainer

        training = RunConfig.model_validate({"kind": "tinker", "model": {"name": "tiny"}, "steps": 0, "training": {
            "lora": True, "lora_r": 4, "seed": seed}}).training
        self.ops = tinker_ops
        self.pool = TenantPool(Trainer.from_spec(training, "tiny", torch.device("cpu")), "tiny")
        self.pool.activate(1, training)
        self.state = tinker_ops.TinkerState()

    def __call__(self, op: str, payload: dict) -> dict:
        if op == "optim_step":
            return self.ops.optim_step(self.pool, self.state, payload)
        return self.ops.forward_backward(self.pool, self.state, payload, backward=op == "forward_backward")

    def adapter(self) -> dict[str, torch.Tensor]:
        return {n: p.data.clone() for n, p in self.pool.params.items()}


def saved_adapter(run_id: int) -> dict[str, torch.Tensor]:
    from app.tasks.tinker import state_path

    return torch.load(state_path(run_id), weights_only=True)["adapter"]


def run_id_of(model_id: str) -> int:
    return int(model_id.removeprefix("tinker-"))


def test_ops_equal_direct_and_state_round_trips(var, one_thread):
    model = make_model()
    direct = Direct()
    steps = [("forward_backward", batch(1)), ("forward_backward", batch(2, "ppo")), ("optim_step", ADAM),
             ("forward", batch(3)), ("forward_backward", batch(4, "importance_sampling")), ("optim_step", ADAM)]
    for op, payload in steps:
        assert run(model, op, payload) == direct(op, payload), op
    adapter = direct.adapter()
    assert all(torch.equal(saved_adapter(run_id_of(model))[n], t) for n, t in adapter.items())
    saved = run(model, "save_weights", {"model_id": model, "path": "two-steps"})
    assert saved == {"path": f"tinker://{model}/weights/two-steps", "type": "save_weights"}
    run(model, "forward_backward", batch(5))
    run(model, "optim_step", ADAM)
    loaded = run(model, "load_weights", {"model_id": model, "path": saved["path"], "optimizer": True})
    assert loaded["path"] == saved["path"]
    # after the load the model continues exactly as the direct run does after its second step
    for op, payload in [("forward_backward", batch(6)), ("optim_step", ADAM)]:
        assert run(model, op, payload) == direct(op, payload), op
    # a second save under the same name is refused, as the caller's error
    from app.tasks.tinker import run_future

    again = submit(model, "save_weights", {"model_id": model, "path": "two-steps"})
    assert run_future(again) == "failed"
    assert row(again).error["category"] == "User" and "exists" in row(again).error["error"]


def test_lost_tenant_is_restored_and_its_gradients_replayed(var, one_thread):
    from app.training import tinker_ops

    model = make_model()
    direct = Direct()
    for op, payload in [("forward_backward", batch(1)), ("optim_step", ADAM), ("forward_backward", batch(2)),
                        ("forward_backward", batch(3, "ppo"))]:
        assert run(model, op, payload) == direct(op, payload)
    tinker_ops.reset_resident()  # what a restarted gpu worker holds: nothing
    assert run(model, "optim_step", ADAM) == direct("optim_step", ADAM)
    assert all(torch.equal(saved_adapter(run_id_of(model))[n], t) for n, t in direct.adapter().items())
    with session_scope() as s:
        assert set(s.scalars(select(TinkerFuture.attempts).where(TinkerFuture.model_id == model))) == {1}


def test_a_stale_tenant_of_another_worker_is_restored(var, one_thread):
    """Two gpu worker processes, each with its resident pool: worker A ran a forward_backward, then
    worker B ran the next forward_backward and an optim_step.  A's tenant is stale; its next op
    restores B's persisted state instead of stepping on its old gradients."""
    from app.training import tinker_ops

    model = make_model()
    direct = Direct()
    run(model, "forward_backward", batch(1))
    worker_a = tinker_ops._RESIDENT.pool
    tinker_ops._RESIDENT.pool = None  # worker B: a process of its own
    run(model, "forward_backward", batch(2))
    run(model, "optim_step", ADAM)
    tinker_ops._RESIDENT.pool = worker_a  # back on worker A
    run(model, "forward_backward", batch(3))
    got = run(model, "optim_step", ADAM)
    for op, payload in [("forward_backward", batch(1)), ("forward_backward", batch(2)), ("optim_step", ADAM),
                        ("forward_backward", batch(3))]:
        direct(op, payload)
    assert got == direct("optim_step", ADAM)
    assert all(torch.equal(saved_adapter(run_id_of(model))[n], t) for n, t in direct.adapter().items())


def test_optim_step_killed_after_its_state_was_written_steps_once(var, one_thread):
    from app.tasks.tinker import run_future, state_path
    from app.training import tinker_ops

    model = make_model()
    direct = Direct()
    run(model, "forward_backward", batch(1))
    direct("forward_backward", batch(1))
    expected = direct("optim_step", ADAM)
    step = submit(model, "optim_step", ADAM)
    assert run_future(step) == "completed"
    # The worker died between writing its state and completing: the row is still running, its lease gone.
    with session_scope() as s:
        s.execute(TinkerFuture.__table__.update().where(TinkerFuture.id == step).values(
            status="running", result=None, lease_expires_at=None, finished_at=None))
    tinker_ops.reset_resident()
    assert run_future(step) == "completed"
    assert row(step).result == expected and row(step).attempts == 2
    blob = torch.load(state_path(run_id_of(model)), weights_only=True)
    assert blob["optim_steps"] == 1
    assert all(torch.equal(blob["adapter"][n], t) for n, t in direct.adapter().items())


def test_bad_request_fails_the_future_as_the_callers_error(var, one_thread):
    from app.tasks.tinker import run_future

    model = make_model()
    payload = batch(1)
    payload["data"][0]["loss_fn_inputs"].pop("target_tokens")
    future_id = submit(model, "forward_backward", payload)
    assert run_future(future_id) == "failed"
    error = row(future_id).error
    assert error["category"] == "User" and "missing ['target_tokens']" in error["error"]
    assert run_future(future_id) == "skipped"  # a redelivery of a finished future does nothing
    bad_path = submit(model, "load_weights", {"model_id": model, "path": "tinker://x/sampler_weights/a",
                                              "optimizer": False})
    assert run_future(bad_path) == "failed" and "weights/<name>" in row(bad_path).error["error"]


def test_sigkill_mid_forward_backward_applies_once(var, redis_db, spawn, database, one_thread):
    from app.celery import app as celery_app
    from app.tasks.send import TINKER_GPU_TASK

    redis_url = f"{REDIS_BASE}/{REDIS_DB}"

    def send_tinker_future(future_id: int, op: str) -> None:  # send.py's message, on this module's broker
        with celery_app.connection_for_write(redis_url) as connection:
            celery_app.send_task(TINKER_GPU_TASK, args=[future_id], queue="gpu", connection=connection)
    env = {"DATABASE_URL": database, "REDIS_URL": redis_url, "TURNSTILE_VISIBILITY_TIMEOUT": "6",
           "TURNSTILE_TINKER_LEASE_S": "3", "TURNSTILE_VAR_DIR": str(var), "TURNSTILE_TRAINER_THREADS": "1"}
    model = make_model()
    payload = batch(1, "ppo", n=4, length=24)
    first = spawn(celery_worker_args("gpu", concurrency=1, name="gpu1"),
                  {**env, "TURNSTILE_TINKER_TEST_DELAY_S": "120"}, name="gpu1")
    future_id = submit(model, "forward_backward", payload)
    send_tinker_future(future_id, "forward_backward")
    wait_for(lambda: "tinker test delay" in first.output(), 120,
             what=lambda: f"the gradients to be computed\n{first.output()[-3000:]}")
    assert row(future_id).status == "running"
    first.kill()  # SIGKILL to the worker's process group: parent and pool child
    second = spawn(celery_worker_args("gpu", concurrency=1, name="gpu2"), env, name="gpu2")
    wait_for(lambda: row(future_id).status in ("completed", "failed"), 120,
             what=lambda: f"the future to finish after the restart\n{second.output()[-3000:]}")
    done = row(future_id)
    assert done.status == "completed" and done.attempts == 2, done.error
    step = submit(model, "optim_step", ADAM)
    send_tinker_future(step, "optim_step")
    wait_for(lambda: row(step).status in ("completed", "failed"), 60, what=lambda: second.output()[-3000:])
    direct = Direct()
    assert done.result["metrics"] == direct("forward_backward", payload)["metrics"]
    expected = direct("optim_step", ADAM)
    got = row(step).result
    assert got["metrics"]["grad_norm"] == pytest.approx(expected["metrics"]["grad_norm"], rel=1e-6)  # not 2x
    adapter = saved_adapter(run_id_of(model))
    for name, tensor in direct.adapter().items():
        torch.testing.assert_close(adapter[name], tensor, rtol=1e-6, atol=1e-8)


def test_a_model_runs_its_ops_in_order(var, one_thread):
    """A future whose earlier sibling of the same model is unfinished is retried, not run."""
    from celery.exceptions import Retry

    from app.tasks.tinker import run_future

    model = make_model()
    first = submit(model, "forward_backward", batch(1))
    second = submit(model, "optim_step", ADAM)
    with pytest.raises(Retry):
        run_future(second)
    assert row(second).status == "pending" and row(second).attempts == 0
    assert run_future(first) == "completed" and run_future(second) == "completed"
    assert row(second).result["metrics"]["grad_norm"] > 0  # the step saw the first op's gradients


def test_an_op_yields_the_trainer_to_a_waiting_run_that_had_less(var, one_thread):
    """A pending RL step whose run used less of the trainer goes first: the op retries
    (app.control.trainer_shares), at most MAX_YIELDS times, and records its own seconds when it runs."""
    from celery.exceptions import Retry

    from app.control import trainer_shares
    from app.tables import TrainingStep
    from app.tasks.tinker import run_future

    model = make_model()
    trainer_shares.forget(run_id_of(model))
    with session_scope() as s:
        rl = Run(kind="train", status="running", config=RunConfig(kind="train").model_dump(mode="json"))
        s.add(rl)
        s.flush()
        trainer_shares.forget(rl.id)
        step = TrainingStep(run_id=rl.id, step=1, status="pending")
        s.add(step)
        s.flush()
        rl_id, step_id = rl.id, step.id
    trainer_shares.record(run_id_of(model), 5.0)
    trainer_shares.record(rl_id, 1.0)
    first = submit(model, "forward", batch(1))
    with pytest.raises(Retry):
        run_future(first)
    assert (row(first).status, row(first).attempts) == ("pending", 0)
    assert run_future(first, yields=trainer_shares.MAX_YIELDS) == "completed"  # yielded enough: it runs
    assert trainer_shares.usage([run_id_of(model)])[run_id_of(model)] > 5.0    # and its time counts
    with session_scope() as s:
        s.get(TrainingStep, step_id).status = "training"  # the RL step has the trainer: nothing waits
    assert run_future(submit(model, "forward", batch(2))) == "completed"
