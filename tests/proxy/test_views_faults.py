"""Faults of model-API proxies serving coding agents, each checked in all four client APIs,
streaming and not, through the gateway under gunicorn and the scripted engine, with the real
SDK clients wherever the SDK can send the case (raw HTTP where it cannot: compressed bodies,
lone surrogates, a socket closed mid-request)."""
from __future__ import annotations

import gzip
import json
import time
import zlib

import httpx
import pytest
import zstandard
from support.gateway_calls import APIS, ask, auth_headers, parse, post, request_for
from support.gateway_sdk_calls import sdk_ask
from support import wait_for
from support.gateway import completions

from app.conformance.scripted import directive

BOTH = [False, True]
WRITE = {"path": "src/app.py", "content": "print('hello world')\n" * 10}


# --- a length stop inside a tool call -----------------------------------------------------


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stream", BOTH)
def test_length_stop_inside_a_tool_call_is_not_a_finished_call(sdk, episode, api, stream):
    """At most 60 tokens; the model stops inside write_file's arguments (engine finish `length`):
    the answer says the limit was hit and carries no runnable call."""
    ep, token = episode
    reply = {"tool_calls": [{"name": "write_file", "arguments": WRITE}]}
    a = sdk_ask(sdk, token, api, stream, "write it " + directive(reply), ["write_file"], limit=60)
    assert a.stop == {"anthropic": "max_tokens", "chat": "length", "responses": "incomplete",
                      "gemini": "MAX_TOKENS"}[api]
    if api == "responses":
        assert a.extra["incomplete"] == "max_output_tokens"
        assert a.extra["call_status"] in ([], ["incomplete"])  # never a completed call
        if stream:
            assert a.extra["events"][-1] == "response.incomplete"
    else:
        assert a.calls == []
    rec = completions(ep)[-1]
    assert rec.finish_reason == "length" and 40 < len(rec.sampled_ids) <= 60 and rec.partial is False


# --- reasoning-only answers on Gemini ------------------------------------------------------


@pytest.mark.parametrize("stream", BOTH)
@pytest.mark.parametrize("include_thoughts", [False, True])
def test_gemini_reasoning_only_answer_carries_visible_text(gw, episode, stream, include_thoughts):
    """An answer holding only reasoning still has a non-thought text part (Gemini CLI rejects
    thoughts without response text); the placeholder never reaches the engine's next prompt."""
    ep, token = episode
    extra = {"generationConfig": {"thinkingConfig": {"includeThoughts": include_thoughts}}}
    a = ask(gw, token, "gemini", stream, "x " + directive({"reasoning": "only thinking here"}), extra=extra)
    assert a.status == 200 and a.stop == "STOP"
    assert a.text.strip() and not a.calls
    assert a.reasoning == ("only thinking here" if include_thoughts else "")
    model_parts = ([{"text": a.reasoning, "thought": True}] if a.reasoning else []) + [{"text": a.text}]
    path, body = request_for("gemini", False, "")
    body["contents"] = [{"role": "user", "parts": [{"text": "x"}]}, {"role": "model", "parts": model_parts},
                        {"role": "user", "parts": [{"text": "next"}]}]
    assert post(gw, token, "gemini", path, body).status_code == 200
    sent = completions(ep)[-1].normalized_request["messages"]
    assert [m["role"] for m in sent][-1] == "user" and sent[-1]["content"] == "next"
    assert a.text not in json.dumps(sent)  # the placeholder is the gateway's, not the model's


def test_gemini_sdk_reasoning_only_stream_has_text(sdk, episode):
    _, token = episode
    a = sdk_ask(sdk, token, "gemini", True, "x " + directive({"reasoning": "hmm"}))
    assert a.text.strip() and a.stop == "STOP"


# --- compressed request bodies ------------------------------------------------------------


COMPRESS = {"zstd": lambda b: zstandard.ZstdCompressor().compress(b), "gzip": gzip.compress,
            "deflate": zlib.compress}


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("encoding", sorted(COMPRESS))
@pytest.mark.parametrize("stream", BOTH)
def test_compressed_request_bodies_are_decoded(gw, episode, api, encoding, stream):
    _, token = episode
    path, body = request_for(api, stream, "x " + directive({"text": "decoded fine"}))
    raw = COMPRESS[encoding](json.dumps(body).encode())
    a = parse(api, stream, post(gw, token, api, path, raw, {"content-encoding": encoding}))
    assert a.status == 200 and a.text == "decoded fine"


@pytest.mark.parametrize("api", APIS)
def test_unknown_encoding_is_415_and_a_bomb_is_413_in_the_callers_shape(gw, episode, api):
    _, token = episode
    path, body = request_for(api, False, "x")
    r = post(gw, token, api, path, json.dumps(body).encode(), {"content-encoding": "br"})
    assert r.status_code == 415 and r.headers["x-should-retry"] == "false"
    _assert_error_shape(api, r.json())
    assert "br" in json.dumps(r.json())
    bomb = json.dumps({**body, "pad": "a" * (5 * 1024 * 1024)}).encode()  # 5 MiB > the 4 MiB limit
    for encoding in ("zstd", "gzip"):
        packed = COMPRESS[encoding](bomb)
        assert len(packed) < 64 * 1024
        r = post(gw, token, api, path, packed, {"content-encoding": encoding})
        assert r.status_code == 413, r.text
        _assert_error_shape(api, r.json())
    r = post(gw, token, api, path, b"\x28\xb5\x2f\xfd garbage", {"content-encoding": "zstd"})
    assert r.status_code == 400
    _assert_error_shape(api, r.json())


def _assert_error_shape(api: str, body: dict) -> None:
    if api == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"]
    elif api == "gemini":
        assert body["error"]["code"] >= 400 and body["error"]["status"] and body["error"]["message"]
    else:
        assert body["error"]["type"] and body["error"]["message"]


# --- a non-stream client that leaves --------------------------------------------------------


def _engine_aborted(gw, ep: int) -> list[dict]:
    """The scripted engine's aborted requests of episode `ep` (each with its time, `at`), once
    there is one.  The engine lists a request only when its client closed the connection before
    the answer was sent whole, so one listed is an engine request cut short; the 60 s wait only
    bounds a hang (the tests' answers take longer than that)."""
    def aborted():
        return [x for x in httpx.get(gw.engine_url + "/_scripted/aborted").json()["aborted"]
                if x["episode"] == str(ep)]
    return wait_for(aborted, 60, interval=0.02, what="the engine request to be closed")


@pytest.mark.parametrize("api", APIS)
def test_non_stream_client_disconnect_cancels_the_engine_request(gw, episode, api):
    """The engine would take 80 s (40 tokens, 2 s each); the client gives up after 1.5 s: the
    gateway closes the engine request before the answer is done (the engine lists it as
    aborted), however slowly a loaded box notices.  The engine was asked for a non-stream
    answer, so no sampled token reached the gateway: nothing is recorded."""
    ep, token = episode
    gw.reset_engine()
    full = "abcdefghij" * 4
    path, body = request_for(api, False, "x " + directive({"text": full, "token_delay": 2.0}))
    headers = {**auth_headers(api, token), "content-type": "application/json"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.gateway_url + path, content=json.dumps(body), headers=headers, timeout=1.5)
    assert _engine_aborted(gw, ep)
    sent = [r for r in httpx.get(gw.engine_url + "/_scripted/requests").json()["requests"]
            if r["headers"].get("X-Turnstile-Episode") == str(ep)]
    assert sent and sent[-1]["body"]["stream"] is False
    time.sleep(0.5)  # a record would have been written by now
    assert completions(ep) == []


@pytest.mark.parametrize("api", APIS)
def test_stream_client_disconnect_closes_the_engine_request_at_once(gw, episode, api):
    """A streamed answer (a token every 50 ms, 400 of them): the client leaves after a few
    events, and the gateway's next write fails, so it closes the engine request (the engine
    lists it as aborted) with most of the answer unsampled; what was sampled is recorded as
    partial.  Counted in tokens, not seconds."""
    ep, token = episode
    gw.reset_engine()
    full = "abcdefghij" * 40
    path, body = request_for(api, True, "x " + directive({"text": full, "token_delay": 0.05}))
    headers = {**auth_headers(api, token), "content-type": "application/json"}
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", gw.gateway_url + path, content=json.dumps(body), headers=headers) as resp:
            got = b""
            for chunk in resp.iter_raw():
                got += chunk
                if got.count(b"\n\n") >= 6:
                    break
    assert _engine_aborted(gw, ep)
    [rec] = wait_for(lambda: completions(ep), 60, interval=0.05, what="the partial record")
    # the client read 6 events; the gateway stopped within the first half of the answer
    assert rec.partial and 0 < len(rec.sampled_ids) < len(full) // 2, len(rec.sampled_ids)


# --- bad unicode, and failures while a stream is produced ----------------------------------


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stream", BOTH)
def test_lone_surrogate_becomes_a_replacement_character(gw, episode, api, stream):
    ep, token = episode
    path, body = request_for(api, stream, "SURROGATE " + directive({"text": "fine"}))
    raw = json.dumps(body).replace("SURROGATE", "x \\ud83d y")
    a = parse(api, stream, post(gw, token, api, path, raw))
    assert a.status == 200 and a.text == "fine"
    sent = json.dumps(completions(ep)[-1].normalized_request["messages"], ensure_ascii=False)
    assert "x \ufffd y" in sent


TERMINAL_ERROR = {"anthropic": "error", "chat": "error", "responses": "failed:upstream_error", "gemini": "error"}


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stream", BOTH)
def test_a_failure_while_answering_arrives_in_the_callers_error_shape(gw, episode, api, stream):
    """The engine sends a chunk the gateway cannot read after 3 tokens: streams end with their
    API's error event (Responses: response.failed), non-streams are a 502 in the API's shape."""
    _, token = episode
    a = ask(gw, token, api, stream, "x " + directive({"text": "hello world", "garbage_after": 3}))
    if stream:
        assert a.status == 200 and a.stop == TERMINAL_ERROR[api]  # the grammar validator passed too
    else:
        assert a.status == 502
        _assert_error_shape(api, a.body)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stream", BOTH)
def test_tool_arguments_sent_as_a_json_object_are_relayed(gw, episode, api, stream):
    _, token = episode
    reply = {"tool_calls": [{"name": "write_file", "arguments": WRITE}], "quirk": "args_object"}
    a = ask(gw, token, api, stream, "x " + directive(reply), ["write_file"])
    assert a.status == 200 and a.calls == [("write_file", WRITE)]


# --- empty tool arguments -------------------------------------------------------------------


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stream", BOTH)
def test_empty_tool_arguments_are_an_empty_object(sdk, episode, api, stream):
    _, token = episode
    reply = {"tool_calls": [{"name": "list_files", "arguments": ""}, {"name": "status", "arguments": ""}]}
    a = sdk_ask(sdk, token, api, stream, "x " + directive(reply), ["list_files", "status"])
    assert [n for _, n, _ in a.calls] == ["list_files", "status"]
    want = "{}" if api in ("chat", "responses") else {}
    assert [args for _, _, args in a.calls] == [want, want]


# --- Anthropic prefill ------------------------------------------------------------------------


@pytest.mark.parametrize("stream", BOTH)
def test_anthropic_prefill_is_continued(sdk, gw, episode, stream):
    ep, token = episode
    messages = [{"role": "user", "content": "count " + directive({"text": " 2, 3"})},
                {"role": "assistant", "content": "1,"}]
    a = sdk_ask(sdk, token, "anthropic", stream, "", messages=messages)
    assert a.text == " 2, 3" and a.stop == "end_turn"
    sent = gw.engine_requests()[-1]["body"]
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
    rec = completions(ep)[-1]
    prompt = bytes(t - 3 for t in rec.prompt_ids).decode()
    assert prompt.endswith("<|assistant|>\n1,")


# --- tool-call ids reused by the engine ---------------------------------------------------------


def _call(cid: str, name: str) -> dict:
    return {"name": name, "arguments": {"path": name}, "id": cid}


@pytest.mark.parametrize("api", ["anthropic", "chat", "responses"])
@pytest.mark.parametrize("stream", BOTH)
def test_tool_call_ids_are_unique_within_a_conversation(sdk, gw, episode, api, stream):
    """The engine calls `call_0` in two turns: the client gets two different ids, and when the
    history comes back the engine sees its own `call_0` twice (the prompt is unchanged)."""
    ep, token = episode
    turn1 = sdk_ask(sdk, token, api, stream, "a " + directive({"tool_calls": [_call("call_0", "read")]}), ["read"])
    history = _history(api, "a", turn1.calls[0][0], "read", "one")
    turn2 = sdk_ask(sdk, token, api, stream, "", ["read", "grep"],
                    messages=history + _user(api, "b " + directive({"tool_calls": [_call("call_0", "grep")]})))
    assert turn1.calls[0][0] == "call_0"
    assert turn2.calls[0][0] != "call_0" and turn2.calls[0][0].startswith("call_0")
    history += _user(api, "b") + _history(api, None, turn2.calls[0][0], "grep", "two")
    sdk_ask(sdk, token, api, stream, "", ["read", "grep"], messages=history + _user(api, "c"))
    sent = completions(ep)[-1].normalized_request["messages"]
    ids = [tc["id"] for m in sent for tc in m.get("tool_calls") or []]
    results = [m["tool_call_id"] for m in sent if m["role"] == "tool"]
    assert ids == ["call_0", "call_0"] and results == ["call_0", "call_0"]


def _user(api: str, text: str) -> list:
    return [{"role": "user", "content": text}] if api != "responses" else [
        {"type": "message", "role": "user", "content": text}]


def _history(api: str, user: str | None, cid: str, name: str, output: str) -> list:
    args = {"path": name}
    head = _user(api, user) if user else []
    if api == "anthropic":
        return head + [{"role": "assistant", "content": [{"type": "tool_use", "id": cid, "name": name, "input": args}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": cid, "content": output}]}]
    if api == "chat":
        return head + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": cid, "content": output}]
    return head + [{"type": "function_call", "call_id": cid, "name": name, "arguments": json.dumps(args)},
                   {"type": "function_call_output", "call_id": cid, "output": output}]


@pytest.mark.parametrize("stream", BOTH)
def test_gemini_tool_call_ids_are_unique_within_a_conversation(gw, episode, stream):
    ep, token = episode
    first = ask(gw, token, "gemini", stream, "a " + directive({"tool_calls": [_call("call_0", "read")]}), ["read"])
    path, body = request_for("gemini", stream, "", ["read", "grep"])
    body["contents"] = [
        {"role": "user", "parts": [{"text": "a"}]},
        {"role": "model", "parts": [{"functionCall": {"id": first.call_ids[0], "name": "read", "args": {}}}]},
        {"role": "user", "parts": [{"functionResponse": {"id": first.call_ids[0], "name": "read",
                                                         "response": {"output": "one"}}},
                                   {"text": "b " + directive({"tool_calls": [_call("call_0", "grep")]})}]}]
    second = parse("gemini", stream, post(gw, token, "gemini", path, body))
    assert first.call_ids == ["call_0"] and second.call_ids[0] != "call_0"


# --- cached prompt tokens -------------------------------------------------------------------------


@pytest.mark.parametrize("api", APIS)
def test_cached_tokens_agree_across_stream_and_non_stream(sdk, episode, api):
    _, token = episode
    reply = {"text": "cached", "cached_tokens": 20}
    answers = [sdk_ask(sdk, token, api, s, "x " + directive(reply)) for s in BOTH]
    for a in answers:
        u = a.usage
        if api == "anthropic":
            assert u["cache_read_input_tokens"] == 20 and u["cache_creation_input_tokens"] == 0
        elif api == "chat":
            assert u["prompt_tokens_details"]["cached_tokens"] == 20
        elif api == "responses":
            assert u["input_tokens_details"]["cached_tokens"] == 20
        else:
            assert u["cached_content_token_count"] == 20
    assert answers[0].usage == answers[1].usage
    if api == "anthropic":
        start = answers[1].extra["start_usage"]
        assert start["cache_read_input_tokens"] == 20 and start["input_tokens"] == answers[0].usage["input_tokens"]
