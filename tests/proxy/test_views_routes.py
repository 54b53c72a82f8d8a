"""Routed experts through the gateway: real SDKs -> gateway (gunicorn) -> the embedded engine
serving the tiny Qwen3-MoE (2 MoE layers, 8 experts, top-2).

Each harness API's call stores the engine's routes with the completion ([P + S - 1, 2, 2], equal
to what the engine answers for the same request, and to a fresh full forward's); the client's
answer never carries them; a dense engine is never asked and stores none; a two-turn session
merges into one chain whose routes match a fresh forward of the whole chain, -1 only at its last
token, the second turn's prompt served from the engine's prefix cache.
"""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from app.db import session_scope
from app.engines.modeling import load_model
from app.engines.route_bytes import from_bytes
from app.engines.routing import record_routes, stack_routes
from app.tables import Trajectory
from app.training.store import build_episode_trajectories
from support.engine_process import EngineProcess
from support.gateway import SDKs, completions, free_port, make_episode, start_gateway, stop, wait_http

pytestmark = pytest.mark.slow

SYSTEM, USER = "You are terse.", "Say hello."
LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def moe(gw_stack, tmp_path_factory):
    """(engine URL, gateway URL) of the tiny MoE engine and a gateway in front of it."""
    load_model("tiny-moe")  # the folder exists before the engine subprocess reads it
    engine = EngineProcess("tiny-moe", "--max-model-len", "2048")
    gport = free_port()
    procs = []
    try:
        procs.append(start_gateway(gport, gw_stack.db_url, engine.url,
                                   tmp_path_factory.mktemp("moegw") / "gateway.log"))
        wait_http(f"http://127.0.0.1:{gport}/health")
        yield engine.url, f"http://127.0.0.1:{gport}"
    finally:
        stop(procs)
        engine.stop()


@pytest.fixture(scope="module")
def reference_model():
    return load_model("tiny-moe")[0]


def fresh_routes(model, tokens: list[int]) -> np.ndarray:
    """The routes of one full forward over `tokens`: [len(tokens), layers, top_k]."""
    with torch.no_grad(), record_routes(model) as calls:
        model(torch.tensor([tokens]))
    return stack_routes(calls)


def same_sets(a: np.ndarray, b: np.ndarray) -> float:
    """Share of tokens whose expert set is the same in every layer."""
    return float((np.sort(a, -1) == np.sort(b, -1)).all(-1).all(-1).mean())


def stored_routes(rec) -> np.ndarray:
    assert rec.route_shape == [LAYERS, TOP_K]
    return from_bytes(rec.routed_experts, *rec.route_shape)


def call(sdks: SDKs, token: str, api: str, stream: bool) -> None:
    """One greedy call of `api` through its real SDK."""
    from google.genai import types
    if api == "chat":
        out = sdks.openai(token).chat.completions.create(
            model="m", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
            max_tokens=6, temperature=0, stream=stream)
        if stream:
            list(out)
    elif api == "responses":
        client = sdks.openai(token)
        if stream:
            with client.responses.stream(model="m", instructions=SYSTEM, input=USER, max_output_tokens=6,
                                         temperature=0) as s:
                s.until_done()  # cut at max_output_tokens: response.incomplete, not completed
        else:
            client.responses.create(model="m", instructions=SYSTEM, input=USER, max_output_tokens=6, temperature=0)
    elif api == "anthropic":
        client = sdks.anthropic(token)
        kw = dict(model="c", max_tokens=6, system=SYSTEM, messages=[{"role": "user", "content": USER}],
                  extra_body={"temperature": 0})
        if stream:
            with client.messages.stream(**kw) as s:
                s.get_final_message()
        else:
            client.messages.create(**kw)
    else:
        client = sdks.gemini(token)
        config = types.GenerateContentConfig(system_instruction=SYSTEM, max_output_tokens=6, temperature=0)
        if stream:
            list(client.models.generate_content_stream(model="gemini-x", contents=USER, config=config))
        else:
            client.models.generate_content(model="gemini-x", contents=USER, config=config)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "responses", "anthropic", "gemini"])
def test_each_api_stores_the_engine_s_routes_and_never_shows_them(gw, moe, reference_model, api, stream):
    engine, gateway = moe
    ep, token = make_episode()
    sdks = SDKs(gateway)
    try:
        call(sdks, token, api, stream)
        shown = [bytes(buf) for _, buf in sdks.streams]
        assert len(sdks.validated()) == (1 if stream else 0)  # the stream obeys its API's grammar
    finally:
        sdks.http.close()
    (rec,) = completions(ep)
    assert rec.api == api and rec.normalized_request["return_routed_experts"] is True
    routes = stored_routes(rec)
    tokens = rec.prompt_ids + rec.sampled_ids
    assert routes.shape == (len(tokens) - 1, LAYERS, TOP_K) and len(rec.routed_experts) == 8 * (len(tokens) - 1)
    # The engine's own routes for the same request (greedy: the same tokens).
    sent = {k: v for k, v in rec.normalized_request.items() if k not in ("stream", "stream_options")}
    direct = httpx.post(f"{engine}/v1/chat/completions", json=sent, timeout=120).json()
    assert direct["choices"][0]["token_ids"] == rec.sampled_ids
    np.testing.assert_array_equal(routes, np.array(direct["routed_experts"], dtype=np.int16))
    assert same_sets(routes, fresh_routes(reference_model, tokens[:-1])) >= 0.99
    # What the client got: the stored answer (non-stream) or the SSE bytes it read.
    assert "routed_experts" not in json.dumps(rec.response)
    assert all(b"routed_experts" not in raw for raw in shown)


def test_a_dense_engine_is_not_asked_and_stores_no_routes(gw, real):
    engine, gateway = real
    assert httpx.get(f"{engine}/v1/models").json()["data"][0]["route_shape"] is None
    ep, token = make_episode()
    sdks = SDKs(gateway)
    try:
        call(sdks, token, "chat", False)
        call(sdks, token, "anthropic", True)
    finally:
        sdks.http.close()
    for rec in completions(ep):
        assert rec.sampled_ids and rec.routed_experts is None and rec.route_shape is None
        assert "return_routed_experts" not in rec.normalized_request


def test_two_turns_merge_into_one_chain_with_a_fresh_forward_s_routes(gw, moe, reference_model):
    engine, gateway = moe
    assert httpx.get(f"{engine}/v1/models").json()["data"][0]["route_shape"] == [LAYERS, TOP_K, 8]
    ep, token = make_episode()
    messages = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix issue 7."}]
    hits = []
    for turn in range(2):
        before = httpx.get(f"{engine}/health").json()["prefix_hit_tokens"]
        r = httpx.post(f"{gateway}/v1/chat/completions", headers={"authorization": f"Bearer {token}"}, timeout=120,
                       json={"model": "m", "messages": messages, "max_tokens": 6, "temperature": 1.0, "seed": turn})
        assert r.status_code == 200, r.text
        assert "routed_experts" not in r.text
        hits.append(httpx.get(f"{engine}/health").json()["prefix_hit_tokens"] - before)
        messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""},
                     {"role": "user", "content": f"Still failing {turn}."}]
    first, second = completions(ep)
    assert second.raw_request["splice"].get("completion") == first.id  # tokens in: the chain can extend
    # The second prompt was served from the prefix cache, and its routes still cover every token.
    assert hits[1] >= len(first.prompt_ids)
    r2 = stored_routes(second)
    assert r2.shape == (len(second.prompt_ids) + len(second.sampled_ids) - 1, LAYERS, TOP_K) and (r2 >= 0).all()
    with session_scope() as s:
        rows, report = build_episode_trajectories(s, ep, "prefix_merging")
        assert (report["chains"], report["completions_merged"], report["routed_chains"]) == (1, 1, 1)
        (row,) = rows
        assert row.meta["route_shape"] == [LAYERS, TOP_K]
        chain = from_bytes(row.routed_experts, LAYERS, TOP_K)
        tokens = list(row.token_ids)
        assert s.get(Trajectory, row.id).routed_experts == row.routed_experts
    assert tokens == second.prompt_ids + second.sampled_ids
    assert chain.shape == (len(tokens), LAYERS, TOP_K)
    assert (chain[-1] == -1).all() and (chain[:-1] >= 0).all()  # -1 only at the last token
    known = len(first.prompt_ids) + len(first.sampled_ids) - 1
    np.testing.assert_array_equal(chain[:known], stored_routes(first))  # first writer wins
    assert same_sets(chain[:-1], fresh_routes(reference_model, tokens[:-1])) >= 0.99


def test_an_engine_whose_card_does_not_say_is_asked(gw, episode):
    """The scripted engine's card has no `route_shape` (as vLLM's): it is asked, answers with no
    routes, and the completion stores none."""
    ep, token = episode
    assert "route_shape" not in httpx.get(f"{gw.engine_url}/v1/models").json()["data"][0]
    gw.reset_engine()
    r = httpx.post(f"{gw.gateway_url}/v1/chat/completions", headers={"authorization": f"Bearer {token}"},
                   timeout=60, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    chat = [q for q in gw.engine_requests() if q["path"].startswith("/v1/chat/completions")]
    assert chat[-1]["body"]["return_routed_experts"] is True
    (rec,) = completions(ep)
    assert rec.routed_experts is None and rec.route_shape is None
