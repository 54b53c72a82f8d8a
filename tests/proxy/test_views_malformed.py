"""Bad input: malformed JSON, wrong types, oversize bodies -> 4xx in the caller's own error shape,
never a 5xx, never a record (hypothesis property over all four APIs)."""
from __future__ import annotations

import json

import httpx
import pytest
from support.gateway import completions, make_episode
from support.gateway_calls import auth_headers, request_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.engines.sse import SSEDecoder

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)

SHAPE = {
    "anthropic": lambda b: b["type"] == "error" and isinstance(b["error"]["message"], str),
    "chat": lambda b: isinstance(b["error"]["message"], str) and "type" in b["error"],
    "responses": lambda b: isinstance(b["error"]["message"], str) and "type" in b["error"],
    "gemini": lambda b: isinstance(b["error"]["message"], str) and b["error"]["status"],
}


def _mutations(api: str):
    path, base = request_for(api, False, "hi")
    keys = sorted(set(base) | {"messages", "tools", "tool_choice", "stream", "max_tokens", "system", "input",
                               "contents", "generationConfig", "thinking", "stop", "instructions", "reasoning",
                               "previous_response_id", "stop_sequences", "response_format", "text"})

    def mutate(key, value, nested):
        body = json.loads(json.dumps(base))
        if nested and isinstance(body.get(key), list) and body[key]:
            body[key][0] = value if not isinstance(body[key][0], dict) else {**body[key][0], "content": value,
                                                                             "parts": value, "role": value}
        else:
            body[key] = value
        return json.dumps(body).encode()

    return path, st.builds(mutate, st.sampled_from(keys), json_values, st.booleans())


def _bodies(api: str):
    path, mutated = _mutations(api)
    raw = st.one_of(st.binary(max_size=64), json_values.map(lambda v: json.dumps(v).encode()),
                    st.text(max_size=40).map(lambda t: t.encode("utf-8")), mutated)
    return path, raw


@pytest.mark.parametrize("api", ["anthropic", "chat", "responses", "gemini"])
def test_random_malformed_bodies_never_5xx_nor_record(gw, api):
    ep, token = make_episode()
    path, bodies = _bodies(api)
    headers = {"content-type": "application/json", **auth_headers(api, token)}
    client = httpx.Client(base_url=gw.gateway_url, timeout=30)
    accepted = []

    @settings(max_examples=70, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(bodies)
    def check(raw: bytes):
        before = len(completions(ep))
        r = client.post(path, content=raw, headers=headers)
        assert r.status_code < 500, (r.status_code, raw[:200], r.text[:300])
        if r.status_code == 200:
            accepted.append(raw)
            if r.headers["content-type"].startswith("text/event-stream"):
                SSEDecoder().feed(r.content)
            return
        assert 400 <= r.status_code < 500
        assert SHAPE[api](r.json()), r.text
        assert len(completions(ep)) == before, "a rejected request left a record"

    check()
    client.close()
    # Every accepted call reached the client whole, so each is a call of its own (one row), identical
    # bodies included: only a retry of an answer that was not delivered replaces an earlier row.
    assert len(completions(ep)) == len(accepted)


@pytest.mark.parametrize("api", ["anthropic", "chat", "responses", "gemini"])
def test_oversize_bodies_and_wrong_types_are_4xx_in_shape(gw, api):
    ep, token = make_episode()
    path, body = request_for(api, False, "x" * (5 * 1024 * 1024))  # test gateway limit: 4 MiB
    headers = {"content-type": "application/json", **auth_headers(api, token)}
    r = httpx.post(gw.gateway_url + path, content=json.dumps(body), headers=headers)
    assert r.status_code == 413 and SHAPE[api](r.json())
    wrong = {"generationConfig": "x"} if api == "gemini" else {"stream": "yes"}
    for bad in (b"{not json", b"[1, 2]", b"", json.dumps({**request_for(api, False, "hi")[1], **wrong}).encode()):
        r = httpx.post(gw.gateway_url + path, content=bad, headers=headers)
        assert r.status_code == 400 and SHAPE[api](r.json()), (bad, r.text)
    assert completions(ep) == []
