"""Routing replay on the tiny Qwen3-MoE models: record, replay, gradients, checkpoint recompute, checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from app.engines.modeling import load_model, tiny_moe_config
from app.engines.routing import (
    RouteReplay,
    check_routes,
    decode_routes,
    encode_routes,
    moe_routers,
    record_routes,
    route_shape,
    score_completion,
    stack_routes,
)


@pytest.fixture(scope="module", params=["tiny-moe", "tiny-moe-wide"])
def moe(request):
    model, tokenizer = load_model(request.param)
    return request.param, model, tokenizer


def _ids(tokenizer, text="The quick brown fox jumps over the lazy dog. def f(x): return x"):
    return tokenizer(text, return_tensors="pt").input_ids


def _recorded(model, ids):
    with torch.no_grad(), record_routes(model) as calls:
        logits = model(ids).logits
    return logits, stack_routes(calls)


def test_folder_and_shape(moe):
    name, model, _tok = moe
    config = tiny_moe_config(name)
    assert route_shape(model) == (config.num_hidden_layers, config.num_experts_per_tok, config.num_experts)
    assert len(moe_routers(model)) == 2
    dense, _ = load_model("tiny")
    assert route_shape(dense) is None


def test_recorded_routes_replayed_give_identical_outputs(moe):
    _name, model, tok = moe
    ids = _ids(tok)
    logits, routes = _recorded(model, ids)
    layers, top_k, experts = route_shape(model)
    assert routes.shape == (ids.shape[1], layers, top_k) and routes.dtype == np.int16
    check_routes(routes, ids.shape[1], route_shape(model), "recorded")
    with torch.no_grad(), RouteReplay(model) as replay:
        replay.set(routes)
        replayed = model(ids).logits
    assert torch.equal(logits, replayed)


def test_replay_forces_other_experts_and_router_gets_gradients(moe):
    _name, model, tok = moe
    ids = _ids(tok)
    _logits, routes = _recorded(model, ids)
    experts = route_shape(model)[2]
    forced = (routes.astype(np.int64) + 1) % experts  # a different, still duplicate-free choice
    model.zero_grad()
    with record_routes(model) as seen, RouteReplay(model) as replay:
        replay.set(forced)
        model(ids).logits.float().logsumexp(-1).sum().backward()
    # A recorder hooked before the replay still sees the forced ids (the replay hook runs first).
    assert np.array_equal(stack_routes(seen), forced.astype(np.int16))
    for router in moe_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    model.zero_grad()


def test_replay_with_perturbed_weights_keeps_the_routes(moe):
    _name, model, tok = moe
    ids = _ids(tok)
    _logits, routes = _recorded(model, ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            for router in moe_routers(model):
                router.weight.add_(torch.randn_like(router.weight) * 0.5)
        _, drifted = _recorded(model, ids)
        assert not np.array_equal(drifted, routes)  # the perturbation changes the free routing
        with torch.no_grad(), RouteReplay(model) as replay, record_routes(model) as seen:
            replay.set(routes)
            model(ids)
        assert np.array_equal(stack_routes(seen), routes)
    finally:
        model.load_state_dict(state)


def test_replay_holds_in_activation_checkpointing_recompute(moe):
    _name, model, tok = moe
    ids = _ids(tok)
    _logits, routes = _recorded(model, ids)
    forced = (routes.astype(np.int64) + 1) % route_shape(model)[2]
    grads = []
    for checkpointing in (False, True):
        model.train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad()
        with RouteReplay(model) as replay, record_routes(model) as seen:
            replay.set(forced)
            model(ids).logits.float().logsumexp(-1).sum().backward()
        # With checkpointing each layer runs twice (forward, recompute), both on the forced ids.
        assert all(len(calls) == (2 if checkpointing else 1) for calls in seen)
        assert all(np.array_equal(c.numpy(), forced[:, layer, :]) for layer, calls in enumerate(seen) for c in calls)
        grads.append([r.weight.grad.clone() for r in moe_routers(model)])
        model.activation_checkpointing_disable()
        model.eval()
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(plain, recomputed)
    model.zero_grad()


def test_replay_refuses_routes_of_another_length(moe):
    _name, model, tok = moe
    ids = _ids(tok)
    _logits, routes = _recorded(model, ids)
    with RouteReplay(model) as replay:
        replay.set(routes[:-1])
        with pytest.raises(ValueError, match="rows"):
            model(ids)


def test_check_routes_names_the_problem():
    shape = (2, 2, 8)
    good = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dtype=np.int16)
    check_routes(good, 2, shape, "chain-7")
    with pytest.raises(ValueError, match="chain-7: routes missing"):
        check_routes(None, 2, shape, "chain-7")
    with pytest.raises(ValueError, match="chain-7: routes shape"):
        check_routes(good[:1], 2, shape, "chain-7")
    bad = good.copy()
    bad[1, 0, 1] = 8
    with pytest.raises(ValueError, match="chain-7: expert id out of range"):
        check_routes(bad, 2, shape, "chain-7")
    bad = good.copy()
    bad[0, 1] = [3, 3]
    with pytest.raises(ValueError, match="chain-7: duplicate expert"):
        check_routes(bad, 2, shape, "chain-7")


def test_encode_decode_round_trip_and_size():
    routes = np.random.default_rng(0).integers(0, 32, size=(5, 2, 4)).astype(np.int16)
    data = encode_routes(routes)
    assert len(data) == 5 * 2 * 2 * 4  # 16 bytes per token for 2 layers × top-4
    assert np.array_equal(decode_routes(data, 2, 4), routes)
    with pytest.raises(ValueError, match="multiple"):
        decode_routes(data[:-1], 2, 4)


def test_score_completion_scores_the_completion_over_all_tokens_but_the_last(moe):
    _, model, tokenizer = moe
    ids = _ids(tokenizer)[0].tolist()
    p = 5
    logits, routes = _recorded(model, torch.tensor([ids[:-1]]))
    want = torch.log_softmax(logits[0, p - 1:].float(), -1).gather(-1, torch.tensor(ids[p:])[:, None])[:, 0]
    with torch.no_grad():
        free, seen = score_completion(model, ids, p)
        forced, seen_forced = score_completion(model, ids, p, routes)
    assert torch.equal(free, want) and torch.equal(forced, want)
    assert np.array_equal(seen, routes) and np.array_equal(seen_forced, routes)
    with pytest.raises(ValueError, match="at least one"):
        score_completion(model, ids, len(ids))
    with pytest.raises(ValueError, match="rows"):
        score_completion(model, ids, p, routes[1:])
