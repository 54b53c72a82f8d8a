"""The Tinker ops on a LoRA tenant (app.training.tinker_ops), against direct computations.

forward_backward's loss, logprobs and gradients equal a plain full-logits autograd of the same
loss on the same batch (fp32, CPU: rtol 1e-5 / atol 1e-6, the fused head's chunked logsumexp
against one log_softmax) for each built-in loss and for the SDK's client-side custom loss
(its own `_compute_custom_loss` turns the forward's logprobs into cross_entropy weights);
gradients accumulate across calls exactly as one call over both batches; optim_step is
torch.optim.AdamW with the call's parameters; save_state / load_state round-trip bit-equal.
Tiny random-init model with a 512-token vocabulary (tests/training/test_tenants.py).
"""
from __future__ import annotations

import random
import re

import pytest
import torch
from tinker import types
from tinker.lib.public_interfaces.training_client import TrainingClient

from app.engines.modeling import tiny_config
from app.runconfig import TrainingConfig
from app.training import tinker_ops
from app.training.tenants import TenantPool
from app.training.tinker_losses import LossInputError
from app.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = {"rtol": 1e-5, "atol": 1e-6}
VOCAB = 512  # the LM head dominates the tiny model's cost with SmolLM2's 49,152


def config() -> TrainingConfig:
    return TrainingConfig(lora=True, lora_r=4, lora_alpha=8, seed=7)


def new_pool() -> TenantPool:
    """A pool on the tiny llama (seeded random init, `VOCAB` tokens)."""
    from transformers import LlamaForCausalLM

    cfg = tiny_config()
    cfg.vocab_size = VOCAB
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
    return TenantPool(Trainer(config(), model), "tiny")


def tensor(values, dtype="float32") -> dict:
    return {"data": list(values), "dtype": dtype, "shape": [len(values)]}


def batch(seed: int, loss_fn: str, n: int = 3, config_=None) -> dict:
    """A ForwardBackwardInput JSON of `n` random datums (lengths 5..12) for `loss_fn`."""
    rng = random.Random(seed)
    data = []
    for _ in range(n):
        length = rng.randrange(5, 13)
        tokens = [rng.randrange(3, VOCAB) for _ in range(length + 1)]
        inputs = {"target_tokens": tensor(tokens[1:], "int64")}
        if loss_fn == "cross_entropy":
            inputs["weights"] = tensor([float(i >= length // 2) for i in range(length)])
        else:
            inputs["logprobs"] = tensor([-6.2 + rng.uniform(-0.5, 0.5) for _ in range(length)])
            inputs["advantages"] = tensor([rng.choice((1.0, -0.5, 0.0)) for _ in range(length)])
        data.append({"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
                     "loss_fn_inputs": inputs})
    return {"data": data, "loss_fn": loss_fn, "loss_fn_config": config_}


def direct(pool, payload: dict) -> tuple[float, list[torch.Tensor], dict[str, torch.Tensor]]:
    """(loss sum, logprobs per datum, grads by name): full logits, one log_softmax, the loss written
    out here from Tinker's definitions, autograd; the pool's parameters' grads are cleared after."""
    model = pool.trainer.model
    total, logprobs = 0.0, []
    low, high = 0.8, 1.2
    if payload["loss_fn_config"]:
        low, high = payload["loss_fn_config"]["clip_low_threshold"], payload["loss_fn_config"]["clip_high_threshold"]
    loss = 0.0
    for datum in payload["data"]:
        ids = torch.tensor(datum["model_input"]["chunks"][0]["tokens"])[None]
        inputs = {k: torch.tensor(v["data"]) for k, v in datum["loss_fn_inputs"].items()}
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        lp = torch.log_softmax(logits, -1).gather(-1, inputs["target_tokens"][:, None])[:, 0]
        if payload["loss_fn"] == "cross_entropy":
            per = -(inputs["weights"] * lp)
        else:
            ratio = torch.exp(lp - inputs["logprobs"])
            adv = inputs["advantages"]
            per = -ratio * adv if payload["loss_fn"] == "importance_sampling" else \
                -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)
        loss = loss + per.sum()
        logprobs.append(lp.detach())
    loss.backward()
    total = float(loss.detach())
    grads = {name: p.grad.clone() for name, p in pool.params.items()}
    for p in pool.params.values():
        p.grad = None
    return total, logprobs, grads


def norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])))


def trained_pool(steps: int = 1):
    """A pool with tenant 1 after `steps` forward_backward + optim_step (lr 1e-2), so lora_B != 0."""
    pool = new_pool()
    pool.activate(1, config())
    state = tinker_ops.TinkerState()
    for i in range(steps):
        tinker_ops.forward_backward(pool, state, batch(100 + i, "cross_entropy"))
        tinker_ops.optim_step(pool, state, {"adam_params": {"learning_rate": 1e-2}})
    return pool, state


@pytest.mark.parametrize("loss_fn, loss_config", [
    ("cross_entropy", None), ("importance_sampling", None), ("ppo", None),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05})])
def test_forward_backward_equals_direct(loss_fn, loss_config):
    pool, _ = trained_pool()
    state = tinker_ops.TinkerState()
    payload = batch(1, loss_fn, config_=loss_config)
    out = tinker_ops.forward_backward(pool, state, payload)
    total, logprobs, grads = direct(pool, payload)
    assert out["metrics"]["loss:sum"] == pytest.approx(total, rel=1e-5, abs=1e-6)
    assert len(out["loss_fn_outputs"]) == 3
    for got, want in zip(out["loss_fn_outputs"], logprobs):
        assert got["logprobs"]["shape"] == [want.numel()] and got["logprobs"]["dtype"] == "float32"
        torch.testing.assert_close(torch.tensor(got["logprobs"]["data"]), want, **TOL)
    elementwise = sum(sum(o["elementwise_loss"]["data"]) for o in out["loss_fn_outputs"])
    assert elementwise == pytest.approx(total, rel=1e-5, abs=1e-6)
    assert norm(state.grads) == pytest.approx(norm(grads), rel=1e-5) and norm(grads) > 0
    for name, g in grads.items():
        torch.testing.assert_close(state.grads[name], g, **TOL)


def test_forward_only_leaves_gradients():
    pool, _ = trained_pool()
    state = tinker_ops.TinkerState()
    payload = batch(2, "cross_entropy")
    out = tinker_ops.forward_backward(pool, state, payload, backward=False)
    _, logprobs, _ = direct(pool, payload)
    assert state.grads is None
    torch.testing.assert_close(torch.tensor(out["loss_fn_outputs"][0]["logprobs"]["data"]), logprobs[0], **TOL)


def test_accumulation_equals_one_call():
    pool, _ = trained_pool()
    a, b = batch(3, "importance_sampling"), batch(4, "importance_sampling", n=2)
    two = tinker_ops.TinkerState()
    first = tinker_ops.forward_backward(pool, two, a)["metrics"]["loss:sum"]
    second = tinker_ops.forward_backward(pool, two, b)["metrics"]["loss:sum"]
    one = tinker_ops.TinkerState()
    both = tinker_ops.forward_backward(pool, one, {**a, "data": a["data"] + b["data"]})["metrics"]["loss:sum"]
    assert first + second == pytest.approx(both, rel=1e-6)
    for name in one.grads:
        torch.testing.assert_close(two.grads[name], one.grads[name], **TOL)  # padding changes the sum order


def test_custom_loss_through_the_sdks_own_surrogate():
    """The SDK's forward_backward_custom: a forward (cross_entropy) for the logprobs, the user's loss
    differentiated client-side by the SDK, its gradient sent back as cross_entropy weights."""
    pool, _ = trained_pool()
    payload = batch(5, "cross_entropy")
    forward = tinker_ops.forward_backward(pool, tinker_ops.TinkerState(), payload, backward=False)
    data = [types.Datum(model_input=types.ModelInput.from_ints(d["model_input"]["chunks"][0]["tokens"]),
                        loss_fn_inputs={"target_tokens": types.TensorData(**d["loss_fn_inputs"]["target_tokens"]),
                                        "weights": types.TensorData(**d["loss_fn_inputs"]["weights"])})
            for d in payload["data"]]
    result = types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", metrics=forward["metrics"],
        loss_fn_outputs=[{k: types.TensorData(**v) for k, v in o.items()} for o in forward["loss_fn_outputs"]])

    def custom(data, logprobs_list):  # a nonlinear loss of the logprobs
        return sum((lp ** 2).sum() * 0.01 for lp in logprobs_list), {}

    linear = TrainingClient._compute_custom_loss(data, custom, result)
    backward = {"loss_fn": "cross_entropy", "loss_fn_config": None, "data": [
        {"model_input": d["model_input"], "loss_fn_inputs": {
            "target_tokens": d["loss_fn_inputs"]["target_tokens"],
            "weights": tensor(datum.loss_fn_inputs["weights"].to_torch().tolist())}}
        for d, datum in zip(payload["data"], linear.data)]}
    state = tinker_ops.TinkerState()
    tinker_ops.forward_backward(pool, state, backward)
    # the same custom loss by direct autograd
    model = pool.trainer.model
    loss = 0.0
    for d in payload["data"]:
        ids = torch.tensor(d["model_input"]["chunks"][0]["tokens"])[None]
        targets = torch.tensor(d["loss_fn_inputs"]["target_tokens"]["data"])
        lp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), -1)
        loss = loss + (lp.gather(-1, targets[:, None])[:, 0] ** 2).sum() * 0.01
    loss.backward()
    assert linear.loss_sum == pytest.approx(float(loss.detach()), rel=1e-5)
    for name, p in pool.params.items():
        torch.testing.assert_close(state.grads[name], p.grad, **TOL)


def test_optim_step_is_adamw_with_the_calls_params():
    pool, _ = trained_pool()
    state = tinker_ops.TinkerState()
    names = list(pool.params)
    ref = [pool.params[n].detach().clone().requires_grad_(True) for n in names]
    adamw = torch.optim.AdamW(ref, lr=1.0)
    calls = [{"learning_rate": 3e-3, "beta1": 0.8, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.1},
             {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.0,
              "grad_clip_norm": 0.01}]
    # the pool's optimizer already holds tenant 1's moments; tenant 2 starts fresh, as `ref` does
    pool.activate(2, config())
    for n, r in zip(names, ref):
        with torch.no_grad():
            pool.params[n].data.copy_(r)
    for i, adam in enumerate(calls):
        tinker_ops.forward_backward(pool, state, batch(10 + i, "cross_entropy"))
        grads = [state.grads[n].clone() for n in names]
        metrics = tinker_ops.optim_step(pool, state, {"adam_params": adam})["metrics"]
        total = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        assert metrics["grad_norm"] == pytest.approx(total, rel=1e-6) and metrics["optim_step"] == i + 1
        for r, g in zip(ref, grads):
            r.grad = g
        if adam.get("grad_clip_norm"):
            torch.nn.utils.clip_grad_norm_(ref, adam["grad_clip_norm"])
        for group in adamw.param_groups:
            group.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"],
                         weight_decay=adam["weight_decay"])
        adamw.step()
        for n, r in zip(names, ref):
            assert torch.equal(pool.params[n].data, r.detach()), n
        assert state.grads is None and all(p.grad is None for p in pool.params.values())


def test_save_then_load_restores_bit_equal(tmp_path):
    pool, state = trained_pool(steps=2)
    tinker_ops.forward_backward(pool, state, batch(7, "cross_entropy"))
    path = tmp_path / "state.pt"
    tinker_ops.save_state(pool, state, path, {"applied_through": 12})
    saved = {n: p.data.clone() for n, p in pool.params.items()}
    moments = {n: {k: v.clone() for k, v in pool.trainer.optimizer.state[p].items()} for n, p in pool.params.items()}
    tinker_ops.optim_step(pool, state, {"adam_params": {"learning_rate": 5e-2}})  # moves everything
    assert not torch.equal(next(iter(saved.values())), next(iter(pool.params.values())).data)
    meta = tinker_ops.load_state(pool, state, path)
    assert meta == {"applied_through": 12} and state.optim_steps == 2 and state.grads is None
    for n, p in pool.params.items():
        assert torch.equal(p.data, saved[n]), n
        now = pool.trainer.optimizer.state[p]
        assert set(now) == set(moments[n]) and all(torch.equal(now[k], moments[n][k]) for k in now), n
    # weights only: AdamW starts over
    tinker_ops.load_state(pool, state, path, optimizer=False)
    assert state.optim_steps == 0 and all(p not in pool.trainer.optimizer.state for p in pool.params.values())
    assert all(torch.equal(p.data, saved[n]) for n, p in pool.params.items())


def test_gradients_survive_another_tenant_between_calls():
    pool, _ = trained_pool()
    a, b = batch(8, "cross_entropy"), batch(9, "cross_entropy")
    alone = tinker_ops.TinkerState()
    pool.activate(3, config())
    tinker_ops.forward_backward(pool, alone, a)
    tinker_ops.forward_backward(pool, alone, b)
    interleaved = tinker_ops.TinkerState()
    pool.activate(4, config())
    tinker_ops.forward_backward(pool, interleaved, a)
    pool.activate(1, config())
    tinker_ops.forward_backward(pool, tinker_ops.TinkerState(), batch(20, "cross_entropy"))
    pool.activate(4, config())
    tinker_ops.forward_backward(pool, interleaved, b)
    for name in alone.grads:
        assert torch.equal(alone.grads[name], interleaved.grads[name]), name


@pytest.mark.parametrize("mutate, message", [
    (lambda p: p.update(loss_fn="dro"), "not supported here"),
    (lambda p: p["data"][0]["loss_fn_inputs"].pop("advantages"), "missing ['advantages']"),
    (lambda p: p["data"][1]["loss_fn_inputs"].update(mask=tensor([1.0])), "unexpected ['mask']"),
    (lambda p: p["data"][0]["loss_fn_inputs"].update(logprobs=tensor([0.0])), "has 1 values"),
    (lambda p: p.update(loss_fn_config={"clip_low_threshold": 1.5}), "0 <= low <= 1 <= high"),
    (lambda p: p["data"][0]["loss_fn_inputs"]["target_tokens"]["data"].__setitem__(0, VOCAB), "outside [0, 512)"),
])
def test_bad_requests_are_refused_before_any_work(mutate, message):
    pool, _ = trained_pool()
    payload = batch(11, "ppo")
    mutate(payload)
    state = tinker_ops.TinkerState()
    with pytest.raises(LossInputError, match=re.escape(message)):
        tinker_ops.forward_backward(pool, state, payload)
    assert state.grads is None


def test_bad_adam_params_are_refused():
    pool, state = trained_pool()
    with pytest.raises(LossInputError, match="beta1=1.5"):
        tinker_ops.optim_step(pool, state, {"adam_params": {"beta1": 1.5}})
    with pytest.raises(LossInputError, match="AdamParams only"):
        tinker_ops.optim_step(pool, state, {"optim_params": {"type": "dimuon", "learning_rate": 1.0}})
    assert state.optim_steps == 1
