"""One tool call at a time: `parallel_tool_calls: false` (Chat Completions, Responses) and
`tool_choice.disable_parallel_tool_use: true` (Anthropic) show the client at most one call, stream
and non-stream, while the record keeps every token the policy sampled and names the calls it
withheld (app/proxy/canonical.py `withhold_calls`).  The scripted engine samples two calls; the
next turn's prompt still extends the sampled ids and the session merges into one chain.  Gemini
has no such control (its `functionCallingConfig` holds modes and allowed names only).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from support.gateway import completions

from app.conformance.scripted import directive, encode, logprob, plan
from app.proxy.canonical import result_from_completion
from app.training.trajectories import CompletionRecord, prefix_merging

CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]
REPLY = {"text": "", "tool_calls": [{"name": n, "arguments": a} for n, a in CALLS]}
SCHEMA = {"type": "object", "properties": {}}


def check_turns(ep: int, shown_call_id: str) -> None:
    """The first record holds both sampled calls and withholds the second; the second record's
    prompt extends the first's prompt + sampled ids; the session is one chain."""
    first, second = completions(ep)
    steps, _, _ = plan(REPLY, first.normalized_request)
    assert first.sampled_ids == encode("".join(s["text"] for s in steps))  # both calls, every token
    assert first.logprobs == [float(np.float32(logprob(i, t))) for i, t in enumerate(first.sampled_ids)]
    assert first.finish_reason == "tool_calls"  # the engine's
    withheld = first.normalized_request["turnstile_withheld_tool_calls"]
    assert [(w["name"], json.loads(w["arguments"])) for w in withheld] == CALLS[1:]
    assert "tool_calls_withheld" in first.normalized_request["turnstile_flags"]
    assert shown_call_id in json.dumps(first.response) and withheld[0]["id"] not in json.dumps(first.response)
    assert second.raw_request["splice"]["completion"] == first.id
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.sampled_ids)] == first.prompt_ids + first.sampled_ids
    merged = prefix_merging([CompletionRecord(r.seq, r.prompt_ids, r.sampled_ids, r.logprobs, r.finish_reason, r.id)
                             for r in (first, second)]).report
    assert (merged["chains"], merged["chains_cut"]) == (1, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_disable_parallel_tool_use_shows_one_call(sdk, episode, stream):
    ep, token = episode
    client = sdk.anthropic(token)
    tools = [{"name": n, "description": n, "input_schema": SCHEMA} for n, _ in CALLS]
    msgs = [{"role": "user", "content": "weather and time? " + directive(REPLY)}]
    kw = dict(model="claude-x", max_tokens=400, tools=tools, messages=msgs,
              tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    if stream:
        with client.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kw)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == CALLS[:1] and msg.stop_reason == "tool_use"
    msgs += [{"role": "assistant", "content": msg.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"},
                                          {"type": "text", "text": "and? " + directive({"text": "ok"})}]}]
    kw.update(messages=msgs)
    assert client.messages.create(**kw).content[0].text == "ok"
    check_turns(ep, uses[0].id)


def _chat(client, stream: bool, **kw) -> tuple[list, str]:
    """([(id, name, args)], finish_reason) from the SDK."""
    if not stream:
        r = client.chat.completions.create(**kw)
        calls = [(t.id, t.function.name, json.loads(t.function.arguments)) for t in r.choices[0].message.tool_calls]
        return calls, r.choices[0].finish_reason
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for t in ch.delta.tool_calls or []:
                c = calls.setdefault(t.index, [t.id, t.function.name, ""])
                c[2] += t.function.arguments or ""
            finish = ch.finish_reason or finish
    return [(i, n, json.loads(a)) for i, n, a in calls.values()], finish


@pytest.mark.parametrize("stream", [False, True])
def test_chat_parallel_tool_calls_false_shows_one_call(sdk, episode, stream):
    ep, token = episode
    client = sdk.openai(token)
    tools = [{"type": "function", "function": {"name": n, "parameters": SCHEMA}} for n, _ in CALLS]
    msgs = [{"role": "user", "content": "weather and time? " + directive(REPLY)}]
    calls, finish = _chat(client, stream, model="gpt-x", messages=msgs, tools=tools, parallel_tool_calls=False)
    assert [(n, a) for _, n, a in calls] == CALLS[:1] and finish == "tool_calls"
    msgs += [{"role": "assistant", "content": None, "tool_calls": [
                 {"id": calls[0][0], "type": "function",
                  "function": {"name": calls[0][1], "arguments": json.dumps(calls[0][2])}}]},
             {"role": "tool", "tool_call_id": calls[0][0], "content": "sunny"},
             {"role": "user", "content": "and? " + directive({"text": "ok"})}]
    r = client.chat.completions.create(model="gpt-x", messages=msgs, tools=tools, parallel_tool_calls=False)
    assert r.choices[0].message.content == "ok"
    check_turns(ep, calls[0][0])


@pytest.mark.parametrize("stream", [False, True])
def test_responses_parallel_tool_calls_false_shows_one_call(sdk, episode, stream):
    ep, token = episode
    client = sdk.openai(token)
    tools = [{"type": "function", "name": n, "parameters": SCHEMA} for n, _ in CALLS]
    kw = dict(model="gpt-5-codex", tools=tools, parallel_tool_calls=False,
              input=[{"role": "user", "content": "weather and time? " + directive(REPLY)}])
    if stream:
        with client.responses.stream(**kw) as s:
            r1 = s.get_final_response()
    else:
        r1 = client.responses.create(**kw)
    fcs = [o for o in r1.output if o.type == "function_call"]
    assert [(f.name, json.loads(f.arguments)) for f in fcs] == CALLS[:1] and r1.status == "completed"
    assert r1.parallel_tool_calls is False
    r2 = client.responses.create(model="gpt-5-codex", tools=tools, parallel_tool_calls=False, input=[
        *kw["input"], {"type": "function_call", "call_id": fcs[0].call_id, "name": fcs[0].name,
                       "arguments": fcs[0].arguments},
        {"type": "function_call_output", "call_id": fcs[0].call_id, "output": "sunny"},
        {"role": "user", "content": "and? " + directive({"text": "ok"})}])
    assert r2.output_text == "ok"
    check_turns(ep, fcs[0].call_id)


def test_a_withheld_call_cut_by_the_token_limit_still_shows_a_finished_first_call():
    """The engine stopped for length inside the second call: the client gets the first call,
    finished; the record keeps the engine's finish reason."""
    body = {"choices": [{"index": 0, "finish_reason": "length", "token_ids": [1, 2, 3], "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": '{"y": '}}]}}]}
    r = result_from_completion(body, max_calls=1)
    assert [c.name for c in r.runnable_calls] == ["f"] and r.finish_reason == "tool_calls"
    assert [c.name for c in r.withheld_calls] == ["g"] and r.sampled_finish_reason == "length"
    assert r.sampled_ids == [1, 2, 3]
    every = result_from_completion(body)
    assert [c.name for c in every.tool_calls] == ["f", "g"] and every.runnable_calls[0].name == "f"


@pytest.mark.parametrize("api,field", [("chat", {"parallel_tool_calls": "false"}),
                                       ("anthropic", {"tool_choice": {"type": "auto",
                                                                      "disable_parallel_tool_use": "yes"}})])
def test_a_control_that_is_not_a_boolean_is_a_400(gw, episode, api, field):
    from support.gateway_calls import post, request_for
    _, token = episode
    path, body = request_for(api, False, "x", ["f"], field)
    r = post(gw, token, api, path, body)
    assert r.status_code == 400 and "parallel" in r.text
