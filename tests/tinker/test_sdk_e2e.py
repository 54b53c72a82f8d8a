"""The unmodified tinker SDK (0.38.0) against a whole Turnstile stack on CPU: the Tinker service,
the gpu worker (trainer ops on the model's LoRA tenant), a rollout worker (sampling) and the
embedded engine on the tiny model.  Every primitive through the SDK's own clients and futures:
forward, forward_backward + optim_step (the loss falls), sample with logprobs and compute_logprobs from a
sampler the trainer exported (its logprobs equal the trainer's forward of the same tokens), a named sampler
checkpoint sampled from a second client, save_state / load_state (bit-equal forward after), a
client-side custom loss, the
SDK's retry of a request the key's quota refused (429), and one key kept from another's sampler."""
from __future__ import annotations

import concurrent.futures
import logging

import pytest
import tinker
from tinker import types

from support.tinker_stack import start_stack

PROMPT = [19556, 665, 28, 638, 359, 1250, 314, 6403]


@pytest.fixture
def stack(request, spawn, monkeypatch):
    # max_inflight 1: five samples at once get 429s, which the SDK must back off from and retry.
    return start_stack(request, spawn, monkeypatch, "tiny", keys={"alice": {"max_inflight": 1}, "bob": {}})


def _datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    n = len(tokens) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
                                       "weights": types.TensorData(data=weights or [1.0] * n, dtype="float32",
                                                                   shape=[n])})


def _loss(out: types.ForwardBackwardOutput) -> float:
    return float(out.metrics["loss:sum"])


def _logprobs(out: types.ForwardBackwardOutput) -> list[float]:
    return [float(v) for v in out.loss_fn_outputs[0]["logprobs"].data]


def test_every_primitive_through_the_sdk(stack, key, caplog):
    sc = tinker.ServiceClient(base_url=stack.url, api_key=key("alice"))
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0).result(timeout=120)
    batch = [_datum(PROMPT), _datum(PROMPT[::-1])]
    adam = types.AdamParams(learning_rate=1e-2)

    # forward changes nothing; forward_backward + optim_step, sent back to back (futures), learn.
    before = tc.forward(batch, "cross_entropy").result(timeout=300)
    losses = []
    for _ in range(3):
        fb = tc.forward_backward(batch, "cross_entropy")
        step = tc.optim_step(adam)
        losses.append(_loss(fb.result(timeout=300)))
        assert step.result(timeout=300) is not None
    assert losses[0] == pytest.approx(_loss(before), rel=1e-5)
    assert losses[2] < losses[1] < losses[0], losses

    # sample from the trained weights: the sampler is the tenant's adapter, exported and loaded.
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=300)
    drawn = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=6, seed=1),
                           include_prompt_logprobs=True).result(timeout=300)
    assert len(drawn.sequences) == 2
    assert drawn.prompt_logprobs[0] is None and len(drawn.prompt_logprobs) == len(PROMPT)
    seq = drawn.sequences[0]
    assert len(seq.tokens) == len(seq.logprobs) == 6 and seq.sequence_id
    # token-exact: the trainer's logprobs of the sampled tokens equal the engine's (fp32 both)
    scored = tc.forward([_datum(PROMPT + seq.tokens)], "cross_entropy").result(timeout=300)
    assert _logprobs(scored)[len(PROMPT) - 1:] == pytest.approx(seq.logprobs, abs=2e-3)
    assert _logprobs(scored)[:len(PROMPT) - 1] == pytest.approx(drawn.prompt_logprobs[1:], abs=2e-3)
    scored_prompt = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(timeout=300)
    assert scored_prompt[0] is None and scored_prompt[1:] == pytest.approx(drawn.prompt_logprobs[1:], abs=1e-6)

    # a named sampler checkpoint, sampled from a client of its own (greedy: the same weights agree)
    path = tc.save_weights_for_sampler("after-3").result(timeout=300).path
    assert path == f"tinker://{tc.get_info().model_id}/sampler_weights/after-3"
    greedy = types.SamplingParams(max_tokens=5, temperature=0.0)
    named = sc.create_sampling_client(model_path=path).result(timeout=60).sample(types.ModelInput.from_ints(PROMPT), 1, greedy)
    again = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, greedy)
    assert named.result(timeout=300).sequences[0].tokens == again.result(timeout=300).sequences[0].tokens

    # save_state, one more step, load_state: the forward is the saved one, bit for bit
    state = tc.save_state("s3").result(timeout=300).path
    at_save = _logprobs(tc.forward(batch, "cross_entropy").result(timeout=300))
    tc.forward_backward(batch, "cross_entropy").result(timeout=300)
    tc.optim_step(adam).result(timeout=300)
    assert _logprobs(tc.forward(batch, "cross_entropy").result(timeout=300)) != at_save
    tc.load_state_with_optimizer(state).result(timeout=300)
    assert _logprobs(tc.forward(batch, "cross_entropy").result(timeout=300)) == at_save

    # a client-side custom loss (the SDK sends a cross_entropy surrogate): -sum(logprobs) is the CE loss
    custom = tc.forward_backward_custom(batch, lambda data, lps: (sum(-lp.sum() for lp in lps), {}))
    ce = _loss(tc.forward(batch, "cross_entropy").result(timeout=300))
    assert _loss(custom.result(timeout=300)) == pytest.approx(ce, rel=1e-5)

    # five samples at once against max_inflight 1: the 429s are retried by the SDK, all five land
    caplog.set_level(logging.INFO, logger="httpx")  # httpx logs every response's status line
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        results = list(pool.map(lambda i: sampler.sample(types.ModelInput.from_ints(PROMPT[:4 + i]), 1,
                                                         types.SamplingParams(max_tokens=3, seed=i)).result(timeout=300),
                                range(5)))
    assert [len(r.sequences[0].tokens) for r in results] == [3] * 5
    assert any("asample" in r.getMessage() and " 429 " in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records if "HTTP" in r.getMessage()][-30:]

    # another key can neither sample alice's checkpoint nor tell it from one that does not exist
    bob = tinker.ServiceClient(base_url=stack.url, api_key=key("bob"))
    with pytest.raises(tinker.APIStatusError) as denied:
        bob.create_sampling_client(model_path=path).result(60).sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result(60)
    missing = path.replace(tc.get_info().model_id, "tinker-9999")
    with pytest.raises(tinker.APIStatusError) as absent:
        bob.create_sampling_client(model_path=missing).result(60).sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result(60)
    assert denied.value.status_code == absent.value.status_code == 404


@pytest.fixture
def smollm2_stack(request, spawn, monkeypatch):
    return start_stack(request, spawn, monkeypatch, "smollm2")


def test_smollm2_trains_and_samples_its_adapter(smollm2_stack, key):
    """The packaged model once: a LoRA step on SmolLM2-135M-Instruct, then its exported sampler's
    logprobs against the trainer's forward of the same tokens."""
    sc = tinker.ServiceClient(base_url=smollm2_stack.url, api_key=key("alice"))
    tc = sc.create_lora_training_client(base_model="smollm2", rank=8, seed=0).result(timeout=300)
    tokens = tc.get_tokenizer().encode("The capital of France is Paris. The capital of Italy is Rome.")
    batch = [_datum(tokens)]
    first = tc.forward_backward(batch, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=600)
    second = tc.forward_backward(batch, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=600)
    assert _loss(second.result(timeout=600)) < _loss(first.result(timeout=600))
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=600)
    prompt = tokens[:6]
    seq = sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=8, seed=3)
                         ).result(timeout=600).sequences[0]
    scored = _logprobs(tc.forward([_datum(prompt + seq.tokens)], "cross_entropy").result(timeout=600))
    assert scored[len(prompt) - 1:] == pytest.approx(seq.logprobs, abs=2e-3)
