"""Real openai / anthropic / google-genai SDKs against the gateway (gunicorn) and the scripted engine.

For every API: non-stream and stream, text and parallel tool calls, multi-turn with tool
results.  Each call must produce one Completion row whose prompt ids, sampled ids and
logprobs equal the scripted engine's (derivable: UTF-8 bytes + offset), and the SDK's
parsed answer must equal what the engine produced.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from support.gateway import completions

from app.conformance.scripted import directive, encode, logprob, plan, render_prompt

TOOLS_SPEC = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris", "fmt": "24h"})]
TEXT = "Hello wörld ✓ — 你好"
REASONING = "think about it"


def check_record(rec, reply: dict, token: str) -> None:
    """The record holds exactly what the engine saw and sampled."""
    body = rec.normalized_request
    assert rec.prompt_ids == encode(render_prompt(body))
    steps, finish, _ = plan(reply, body)
    assert rec.sampled_ids == encode("".join(s["text"] for s in steps))
    assert rec.logprobs == [float(np.float32(logprob(i, t))) for i, t in enumerate(rec.sampled_ids)]
    assert rec.partial is False and rec.error is None
    assert rec.policy_version == 7  # scripted engine reports none: the run's version is used
    if rec.stream:
        assert rec.queue_ms is not None and rec.first_token_ms >= rec.queue_ms and rec.total_ms >= rec.first_token_ms
    else:  # a non-stream engine answer arrives whole: no queue or first-token time is known
        assert rec.queue_ms is None and rec.first_token_ms is None and rec.total_ms > 0
    assert token not in json.dumps(rec.raw_request) and token not in json.dumps(rec.normalized_request)
    assert body["return_token_ids"] is True and body["logprobs"] is True


def tool_reply() -> dict:
    return {"text": "", "tool_calls": [{"name": n, "arguments": a} for n, a in TOOLS_SPEC]}


# --- Anthropic --------------------------------------------------------------------------------

ANTHROPIC_TOOLS = [{"name": n, "description": n, "input_schema": {"type": "object", "properties": {}}}
                   for n, _ in TOOLS_SPEC]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_text(sdk, episode, stream):
    ep, token = episode
    client = sdk.anthropic(token)
    reply = {"text": TEXT}
    kw = dict(model="claude-turnstile", max_tokens=300, messages=[{"role": "user", "content": "hi " + directive(reply)}])
    if stream:
        with client.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kw)
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == TEXT
    assert msg.stop_reason == "end_turn" and msg.model == "claude-turnstile"
    [rec] = completions(ep)
    check_record(rec, reply, token)
    assert msg.usage.input_tokens == len(rec.prompt_ids) and msg.usage.output_tokens == len(rec.sampled_ids)
    assert rec.api == "anthropic" and rec.stream is stream and rec.response_id == msg.id
    assert [api for api, _ in sdk.validated()] == (["anthropic"] if stream else [])


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_parallel_tools_and_tool_results(sdk, episode, stream):
    ep, token = episode
    client = sdk.anthropic(token)
    reply = tool_reply()
    msgs = [{"role": "user", "content": "weather and time? " + directive(reply)}]
    kw = dict(model="claude-x", max_tokens=400, tools=ANTHROPIC_TOOLS, messages=msgs)
    if stream:
        with client.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == TOOLS_SPEC
    assert len({u.id for u in uses}) == 2
    # second turn: tool results
    reply2 = {"text": "It is sunny at 12:00."}
    msgs2 = msgs + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"},
                        {"type": "tool_result", "tool_use_id": uses[1].id, "content": [{"type": "text", "text": "12:00"}]},
                        {"type": "text", "text": "thanks " + directive(reply2)}]}]
    kw["messages"] = msgs2
    msg2 = client.messages.create(**kw) if not stream else client.messages.stream(**kw).__enter__().get_final_message()
    assert msg2.content[0].text == reply2["text"]
    r1, r2 = completions(ep)
    assert (r1.seq, r2.seq) == (0, 1)
    check_record(r1, reply, token)
    check_record(r2, reply2, token)
    sent = r2.normalized_request["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "tool", "user"]
    assert [t["id"] for t in sent[1]["tool_calls"]] == [u.id for u in uses]
    assert sent[2]["content"] == "sunny" and sent[3]["content"] == "12:00"


# --- OpenAI Chat Completions -------------------------------------------------------------------

CHAT_TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
              for n, _ in TOOLS_SPEC]


def _chat(client, stream: bool, **kw):
    """(content, tool_calls [(id, name, args)], finish_reason, usage) from the SDK."""
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [(t.id, t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]
        return m.content or "", calls, r.choices[0].finish_reason, r.usage
    content, calls, finish, usage = "", {}, None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                c = calls.setdefault(t.index, [t.id, t.function.name, ""])
                c[2] += t.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [(i, n, json.loads(a)) for i, n, a in calls.values()], finish, usage


@pytest.mark.parametrize("stream", [False, True])
def test_chat_text_and_tools_multiturn(sdk, episode, stream):
    ep, token = episode
    client = sdk.openai(token)
    reply = {"text": TEXT}
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi " + directive(reply)}]
    content, calls, finish, usage = _chat(client, stream, model="gpt-x", messages=msgs)
    assert (content, calls, finish) == (TEXT, [], "stop")
    reply2 = tool_reply()
    msgs += [{"role": "assistant", "content": content}, {"role": "user", "content": "tools " + directive(reply2)}]
    _, calls, finish, _ = _chat(client, stream, model="gpt-x", messages=msgs, tools=CHAT_TOOLS)
    assert finish == "tool_calls" and [(n, a) for _, n, a in calls] == TOOLS_SPEC
    reply3 = {"text": "done"}
    msgs += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for i, n, a in calls]}]
    msgs += [{"role": "tool", "tool_call_id": calls[0][0], "content": "sunny"},
             {"role": "tool", "tool_call_id": calls[1][0], "content": [{"type": "text", "text": "12:00"}]},
             {"role": "user", "content": "ok " + directive(reply3)}]
    content, _, _, usage3 = _chat(client, stream, model="gpt-x", messages=msgs, tools=CHAT_TOOLS)
    assert content == "done"
    recs = completions(ep)
    assert [r.seq for r in recs] == [0, 1, 2]
    for rec, rep in zip(recs, [reply, reply2, reply3]):
        check_record(rec, rep, token)
    assert usage3.prompt_tokens == len(recs[2].prompt_ids) and usage3.completion_tokens == len(recs[2].sampled_ids)
    assert len(sdk.validated()) == (3 if stream else 0)
    assert recs[2].normalized_request["messages"][4]["tool_calls"][1]["id"] == calls[1][0]


# --- OpenAI Responses --------------------------------------------------------------------------

RESP_TOOLS = [{"type": "function", "name": n, "parameters": {"type": "object", "properties": {}}}
              for n, _ in TOOLS_SPEC]


def _responses(client, stream: bool, **kw):
    if not stream:
        return client.responses.create(**kw)
    with client.responses.stream(**kw) as s:
        return s.get_final_response()


@pytest.mark.parametrize("stream", [False, True])
def test_responses_text_tools_and_previous_response(sdk, episode, stream):
    ep, token = episode
    client = sdk.openai(token)
    reply = {"text": TEXT, "reasoning": REASONING}
    r1 = _responses(client, stream, model="gpt-5-codex", input="hi " + directive(reply), reasoning={"effort": "low"})
    assert r1.output_text == TEXT and r1.status == "completed"
    kinds = [o.type for o in r1.output]
    assert kinds == ["reasoning", "message"]
    assert r1.output[0].content[0].text == REASONING
    reply2 = tool_reply()
    r2 = _responses(client, stream, model="gpt-5-codex", previous_response_id=r1.id, tools=RESP_TOOLS,
                    input=[{"role": "user", "content": "tools " + directive(reply2)}])
    fcs = [o for o in r2.output if o.type == "function_call"]
    assert [(f.name, json.loads(f.arguments)) for f in fcs] == TOOLS_SPEC
    reply3 = {"text": "all done"}
    r3 = _responses(client, stream, model="gpt-5-codex", previous_response_id=r2.id, tools=RESP_TOOLS,
                    input=[{"type": "function_call_output", "call_id": fcs[0].call_id, "output": "sunny"},
                           {"type": "function_call_output", "call_id": fcs[1].call_id, "output": "12:00"},
                           {"role": "user", "content": "ok " + directive(reply3)}])
    assert r3.output_text == "all done"
    recs = completions(ep)
    for rec, rep in zip(recs, [reply, reply2, reply3]):
        check_record(rec, rep, token)
    # previous_response_id expanded the whole history, reasoning re-attached to its assistant turn
    roles = [m["role"] for m in recs[2].normalized_request["messages"]]
    assert roles == ["user", "assistant", "user", "assistant", "tool", "tool", "user"]
    assert recs[2].normalized_request["messages"][1]["reasoning"] == REASONING
    assert r3.usage.input_tokens == len(recs[2].prompt_ids)
    assert r3.usage.output_tokens == len(recs[2].sampled_ids)
    assert len(sdk.validated()) == (3 if stream else 0)


# --- Gemini ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_gemini_text_tools_multiturn(sdk, episode, stream):
    from google.genai import types
    ep, token = episode
    client = sdk.gemini(token)
    decls = [types.FunctionDeclaration(name=n, description=n, parameters=types.Schema(type="OBJECT", properties={
        "city": types.Schema(type="STRING")})) for n, _ in TOOLS_SPEC]
    config = types.GenerateContentConfig(tools=[types.Tool(function_declarations=decls)],
                                         system_instruction="be brief")

    def call(contents):
        if not stream:
            r = client.models.generate_content(model="gemini-2.5-pro", contents=contents, config=config)
            return ("".join(p.text or "" for p in r.candidates[0].content.parts if not p.thought),
                    [(p.function_call.id, p.function_call.name, p.function_call.args)
                     for p in r.candidates[0].content.parts if p.function_call],
                    r.candidates[0].finish_reason, r.usage_metadata)
        text, calls, finish, usage = "", [], None, None
        for r in client.models.generate_content_stream(model="gemini-2.5-pro", contents=contents, config=config):
            for cand in r.candidates or []:
                for p in (cand.content.parts if cand.content and cand.content.parts else []):
                    text += p.text or ""
                    if p.function_call:
                        calls.append((p.function_call.id, p.function_call.name, p.function_call.args))
                finish = cand.finish_reason or finish
            usage = r.usage_metadata or usage
        return text, calls, finish, usage

    reply = {"text": TEXT}
    contents = [types.Content(role="user", parts=[types.Part(text="hi " + directive(reply))])]
    text, calls, finish, usage = call(contents)
    assert (text, calls, finish) == (TEXT, [], types.FinishReason.STOP)
    reply2 = tool_reply()
    contents += [types.Content(role="model", parts=[types.Part(text=text)]),
                 types.Content(role="user", parts=[types.Part(text="tools " + directive(reply2))])]
    _, calls, finish, _ = call(contents)
    assert [(n, a) for _, n, a in calls] == TOOLS_SPEC and finish == types.FinishReason.STOP
    reply3 = {"text": "finished"}
    contents += [types.Content(role="model", parts=[types.Part(function_call=types.FunctionCall(id=i, name=n, args=a))
                                                    for i, n, a in calls]),
                 types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                     id=calls[0][0], name=calls[0][1], response={"output": "sunny"})),
                     types.Part(function_response=types.FunctionResponse(
                         id=calls[1][0], name=calls[1][1], response={"output": "12:00"})),
                     types.Part(text="ok " + directive(reply3))])]
    text, _, _, usage = call(contents)
    assert text == "finished"
    recs = completions(ep)
    for rec, rep in zip(recs, [reply, reply2, reply3]):
        check_record(rec, rep, token)
    assert usage.prompt_token_count == len(recs[2].prompt_ids)
    assert usage.candidates_token_count == len(recs[2].sampled_ids)
    sent = recs[2].normalized_request["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user", "assistant", "tool", "tool", "user"]
    assert sent[5]["content"] == "sunny" and sent[5]["tool_call_id"] == calls[0][0]
    assert len(sdk.validated()) == (3 if stream else 0)


@pytest.mark.parametrize("which", ["anthropic", "chat", "responses", "gemini"])
def test_sdks_accept_keepalives_during_prefill(sdk, episode, which):
    """Each SDK silently skips the gateway's keep-alive frames (ping / comment / repeated
    response.in_progress / candidate-less chunk) sent while the engine prefills."""
    _, token = episode
    text = "after a long prefill " + directive({"text": "réady", "prefill_delay": 1.0})
    if which == "anthropic":
        with sdk.anthropic(token).messages.stream(model="c", max_tokens=50,
                                                  messages=[{"role": "user", "content": text}]) as s:
            out = s.get_final_message().content[0].text
    elif which == "chat":
        out = "".join(c.choices[0].delta.content or "" for c in sdk.openai(token).chat.completions.create(
            model="m", stream=True, messages=[{"role": "user", "content": text}]) if c.choices)
    elif which == "responses":
        with sdk.openai(token).responses.stream(model="m", input=text) as s:
            out = s.get_final_response().output_text
    else:
        out = "".join(r.text or "" for r in sdk.gemini(token).models.generate_content_stream(
            model="gemini-x", contents=text))
    assert out == "réady"
    [(api, _)] = sdk.validated()
    raw = bytes(sdk.streams[0][1])
    assert raw.count({"anthropic": b"event: ping", "chat": b": keep-alive",
                      "responses": b"response.in_progress", "gemini": b'data: {"modelVersion"'}[api]) >= 2


def test_responses_retrieve_returns_the_stored_response(sdk, episode):
    _, token = episode
    client = sdk.openai(token)
    created = client.responses.create(model="m", input="hi " + directive({"text": "stored"}))
    got = client.responses.retrieve(created.id)
    assert got.id == created.id and got.output_text == "stored"
