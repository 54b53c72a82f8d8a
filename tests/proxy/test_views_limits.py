"""Bounded decoding through the real gateway (gunicorn), the scripted engine and the real SDKs: a
request whose decoded values or engine request pass their caps is a 413 in the caller's API
shape, asked of no engine, and nothing recorded before it changes (app/proxy/limits.py).

The forged signatures are the reported case: 84 KiB of the gateway's own signature format that
inflated to 64 MiB of "reasoning".  The engine-request cap is shown on a second gateway over the
same engine and database, with a small TURNSTILE_GATEWAY_MAX_PROMPT_BYTES; the SDKs cannot
compress a body, so the gzip case is raw HTTP.
"""
from __future__ import annotations

import gzip
import json
import zlib

import anthropic
import openai
import pytest
from google.genai import errors as genai_errors
from google.genai import types
from support.gateway import Stack, completions, free_port, start_gateway, stop, wait_http
from support.gateway_calls import post

from app.conformance.scripted import directive
from app.proxy import common

PACKED = zlib.compress(b" " * (64 * 1024 * 1024), 9)  # 64 MiB of spaces in about 64 KiB
TEXT_BOMB = common.SIGNATURE_PREFIX + __import__("base64").urlsafe_b64encode(PACKED).decode()
BYTES_BOMB = common.SIGNATURE_PREFIX.encode() + PACKED  # Gemini's thoughtSignature is a bytes field
PROMPT_CAP = 2048


def rows(ep: int) -> list[tuple]:
    """Everything recorded for the episode, to compare before and after a refused request."""
    return [(r.id, r.seq, r.prompt_ids, r.sampled_ids, r.logprobs, r.response, r.partial) for r in completions(ep)]


def engine_saw_no_bomb(gw) -> None:
    assert all(len(json.dumps(r["body"])) < 1024 * 1024 for r in gw.engine_requests())


@pytest.fixture(scope="module")
def small(gw_stack, tmp_path_factory):
    """A second gateway over the same engine and database whose engine requests are capped at
    PROMPT_CAP bytes (the body cap stays 4 MiB)."""
    port = free_port()
    proc = start_gateway(port, gw_stack.db_url, gw_stack.engine_url, tmp_path_factory.mktemp("smallgw") / "gw.log",
                         TURNSTILE_GATEWAY_MAX_PROMPT_BYTES=str(PROMPT_CAP))
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        yield Stack(gw_stack.db_url, gw_stack.engine_url, f"http://127.0.0.1:{port}", [proc])
    finally:
        stop([proc])


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_forged_thinking_signature_is_a_413(sdk, gw, episode, stream):
    ep, token = episode
    client = sdk.anthropic(token, max_retries=0)
    first = [{"role": "user", "content": "hi " + directive({"text": "fine"})}]
    assert client.messages.create(model="claude-x", max_tokens=50, messages=first).content[0].text == "fine"
    before = rows(ep)
    gw.reset_engine()
    forged = first + [{"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": TEXT_BOMB},
                                                        {"type": "text", "text": "fine"}]},
                      {"role": "user", "content": "again"}]
    assert 80 * 1024 < len(json.dumps(forged)) < 90 * 1024
    with pytest.raises(anthropic.APIStatusError) as exc:
        client.messages.create(model="claude-x", max_tokens=50, messages=forged, stream=stream)
    assert exc.value.status_code == 413
    body = exc.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
    assert "messages.1.content.0.signature" in body["error"]["message"]
    assert rows(ep) == before and gw.engine_requests() == []
    again = first + [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "ok " + directive({})}]
    assert client.messages.create(model="claude-x", max_tokens=50, messages=again).content[0].text == "ok"
    assert [r[1] for r in rows(ep)] == [0, 1]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_forged_encrypted_content_is_a_413(sdk, gw, episode, stream):
    ep, token = episode
    client = sdk.openai(token, max_retries=0)
    assert client.responses.create(model="gpt-x", input="hi " + directive({"text": "fine"})).output_text == "fine"
    before = rows(ep)
    gw.reset_engine()
    items = [{"role": "user", "content": "hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": TEXT_BOMB},
             {"role": "assistant", "content": "fine"}, {"role": "user", "content": "again"}]
    with pytest.raises(openai.APIStatusError) as exc:
        client.responses.create(model="gpt-x", input=items, stream=stream)
    assert exc.value.status_code == 413
    err = exc.value.response.json()["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert err["param"] == "input.1.encrypted_content"
    assert rows(ep) == before and gw.engine_requests() == []
    engine_saw_no_bomb(gw)


@pytest.mark.parametrize("stream", [False, True])
def test_gemini_forged_thought_signature_is_a_413(sdk, gw, episode, stream):
    ep, token = episode
    client = sdk.gemini(token)
    hi = types.Content(role="user", parts=[types.Part(text="hi " + directive({"text": "fine"}))])
    assert client.models.generate_content(model="gemini-x", contents=[hi]).text == "fine"
    before = rows(ep)
    gw.reset_engine()
    contents = [hi, types.Content(role="model", parts=[types.Part(text="fine", thought_signature=BYTES_BOMB)]),
                types.Content(role="user", parts=[types.Part(text="again")])]
    with pytest.raises(genai_errors.ClientError) as exc:
        if stream:
            list(client.models.generate_content_stream(model="gemini-x", contents=contents))
        else:
            client.models.generate_content(model="gemini-x", contents=contents)
    assert exc.value.code == 413
    err = exc.value.details["error"]
    assert err["code"] == 413 and err["status"] == "INVALID_ARGUMENT"
    assert "contents[1].parts[0].thoughtSignature" in err["message"]
    assert rows(ep) == before and gw.engine_requests() == []


@pytest.mark.parametrize("stream", [False, True])
def test_chat_small_gzip_body_with_a_large_engine_request_is_a_413(small, gw, episode, stream):
    """3 KB on the wire, 200 KB once decoded: under the body cap, over the engine-request cap."""
    ep, token = episode
    ok = post(small, token, "chat", "/v1/chat/completions",
              {"model": "m", "messages": [{"role": "user", "content": "hi " + directive({"text": "fine"})}]})
    assert ok.status_code == 200, ok.text
    before = rows(ep)
    gw.reset_engine()
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "x" * 200_000}]}
    packed = gzip.compress(json.dumps(body).encode(), mtime=0)
    assert len(packed) < 3 * 1024
    r = post(small, token, "chat", "/v1/chat/completions", packed, {"content-encoding": "gzip"})
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert "TURNSTILE_GATEWAY_MAX_PROMPT_BYTES" in err["message"]
    assert rows(ep) == before and gw.engine_requests() == []


def test_responses_previous_response_chain_past_the_engine_request_cap_is_a_413(sdk, small, gw, episode):
    """A 100-byte request naming a response whose input alone is past the cap (that response
    was made through the first gateway)."""
    ep, token = episode
    client = openai.OpenAI(base_url=f"{small.gateway_url}/v1", api_key=token, max_retries=0)
    first = sdk.openai(token).responses.create(model="gpt-x", input="x" * PROMPT_CAP + directive({"text": "fine"}))
    assert first.output_text == "fine"
    before = rows(ep)
    gw.reset_engine()
    with pytest.raises(openai.APIStatusError) as exc:
        client.responses.create(model="gpt-x", input="and?", previous_response_id=first.id)
    assert exc.value.status_code == 413
    err = exc.value.response.json()["error"]
    assert err["code"] == "request_too_large" and err["param"] == "previous_response_id"
    assert rows(ep) == before and gw.engine_requests() == []
