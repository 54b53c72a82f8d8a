"""Routing: base URLs with and without /v1 or /v1beta, detection by headers and body for unknown
paths, model lists in each API's shape, token counting through the engine's /tokenize."""
from __future__ import annotations

import httpx
import pytest
from support.gateway import completions
from support.gateway_calls import auth_headers

from app.conformance.scripted import encode, render_prompt


@pytest.mark.parametrize("api,path,body", [
    ("anthropic", "/messages", {"model": "c", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}),
    ("anthropic", "/v1/messages?beta=true", {"model": "c", "max_tokens": 20,
                                             "messages": [{"role": "user", "content": "hi"}]}),
    ("chat", "/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("chat", "/openai/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("responses", "/responses", {"model": "m", "input": "hi"}),
    ("gemini", "/v1/models/gemini-x:generateContent", {"contents": [{"parts": [{"text": "hi"}]}]}),
    ("gemini", "/models/gemini-x:generateContent", {"contents": [{"parts": [{"text": "hi"}]}]}),
    ("gemini", "/v1beta/models/models/gemini-x:generateContent", {"contents": [{"parts": [{"text": "hi"}]}]}),
])
def test_base_urls_with_and_without_version_prefix(gw, episode, api, path, body):
    ep, token = episode
    r = httpx.post(gw.gateway_url + path, json=body, headers=auth_headers(api, token))
    assert r.status_code == 200, r.text
    assert completions(ep)[-1].api == api


@pytest.mark.parametrize("headers,body,api", [
    ({"anthropic-version": "2023-06-01"}, {"model": "c", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]},
     "anthropic"),
    ({}, {"contents": [{"parts": [{"text": "x"}]}]}, "gemini"),
    ({}, {"model": "m", "input": "x"}, "responses"),
    ({}, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "chat"),
])
def test_unknown_path_detected_by_headers_then_body(gw, episode, headers, body, api):
    ep, token = episode
    r = httpx.post(gw.gateway_url + "/custom/endpoint", json=body,
                   headers={**headers, "authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    assert completions(ep)[-1].api == api


def test_model_lists_in_each_shape(gw, sdk, episode):
    _, token = episode
    assert "scripted-tiny" in [m.id for m in sdk.openai(token).models.list()]
    ids = [m.id for m in sdk.anthropic(token).models.list()]
    assert "scripted-tiny" in ids and any(i.startswith("claude") for i in ids)
    gem = httpx.get(gw.gateway_url + "/v1beta/models", headers={"x-goog-api-key": token}).json()
    assert "models/scripted-tiny" in [m["name"] for m in gem["models"]]
    assert httpx.head(gw.gateway_url + "/").status_code == 200  # Claude Code 2.1.197 probes HEAD /


def test_count_tokens_uses_the_engines_tokenizer(gw, sdk, episode):
    ep, token = episode
    n = sdk.anthropic(token).messages.count_tokens(model="claude-x", system="sys",
                                                    messages=[{"role": "user", "content": "héllo"}]).input_tokens
    expected = render_prompt({"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "héllo"}]})
    assert n == len(encode(expected))
    g = sdk.gemini(token).models.count_tokens(model="gemini-x", contents="héllo").total_tokens
    assert g == len(encode(render_prompt({"messages": [{"role": "user", "content": "héllo"}]})))
    assert completions(ep) == []  # counting is not a completion
