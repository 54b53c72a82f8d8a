"""Token-in splicing (app/proxy/splice.py) through the real gateway and the scripted engine.

A harness that re-serializes the arguments of an earlier tool call still gets a prompt that
extends the session's chain token for token; an edited assistant turn is rendered from
text and cut with its reason; an answer recorded in another session is never spliced.
"""
from __future__ import annotations

import json

import httpx
from support.gateway import completions, make_episode

from app.conformance.scripted import directive
from app.proxy.splice import canonical_arguments
from app.training.trajectories import CompletionRecord, prefix_merging

ARGS = {"zeta": {"nested": {"b": 1.0, "a": [1.5, "Grüße ✓ 日本"]}}, "alpha": 2.0, "command": "ls -la"}


def _chat(gw, token: str, messages: list[dict]) -> dict:
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    r = httpx.post(f"{gw.gateway_url}/v1/chat/completions", headers={"authorization": f"Bearer {token}"},
                   json={"model": "m", "messages": messages, "tools": tools}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def _first_turn(gw, token: str) -> tuple[list[dict], dict]:
    user = {"role": "user", "content": "do it " + directive({"tool_calls": [{"name": "bash", "arguments": ARGS}]})}
    return [user], _chat(gw, token, [user])


def _reserialized(msg: dict, args: dict | None = None) -> dict:
    """The assistant message as Qwen Code / OpenCode / Pi send it back: arguments parsed and
    re-serialized (compact, ASCII escapes, keys sorted, 1.0 written as 1)."""
    call = msg["tool_calls"][0]
    value = args if args is not None else json.loads(call["function"]["arguments"])
    text = json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=True).replace(".0,", ",")
    return {"role": "assistant", "content": msg.get("content"),
            "tool_calls": [{"id": call["id"], "type": "function", "function": {"name": "bash", "arguments": text}}]}


def _merge(ep: int) -> dict:
    rows = completions(ep)
    return prefix_merging([CompletionRecord(r.seq, r.prompt_ids, r.sampled_ids, r.logprobs, r.finish_reason, r.id)
                           for r in rows]).report


def test_json_equal_arguments_compare_equal():
    assert canonical_arguments('{"b":1,"a":{"x":"\\u00fc"}}') == canonical_arguments({"a": {"x": "ü"}, "b": 1.0})
    assert canonical_arguments('{"a": true}') != canonical_arguments('{"a": 1}')
    assert canonical_arguments('{"a": [1, 2]}') != canonical_arguments('{"a": [2, 1]}')


def test_reserialized_tool_call_arguments_merge(gw):
    ep, token = make_episode()
    history, answer = _first_turn(gw, token)
    sent = _reserialized(answer)
    assert sent["tool_calls"][0]["function"]["arguments"] != answer["tool_calls"][0]["function"]["arguments"]
    tool = {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": "total 0"}
    _chat(gw, token, history + [sent, tool])
    first, second = completions(ep)
    assert second.raw_request["splice"]["completion"] == first.id
    assert second.raw_request["splice"]["prompt_tokens"] == len(second.prompt_ids)  # the engine took the ids
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.sampled_ids)] == first.prompt_ids + first.sampled_ids
    assert "prompt_token_ids" not in second.normalized_request  # the engine's own ids are the record
    # The ids go in both fields engines read: top-level (embedded engine) and vLLM's
    # `kv_transfer_params.prompt_token_ids` (tests/vllm shows vLLM serves that prompt).
    sent_body = gw.engine_requests()[-1]["body"]
    assert sent_body["prompt_token_ids"] == sent_body["kv_transfer_params"]["prompt_token_ids"] == second.prompt_ids
    assert "kv_transfer_params" not in second.normalized_request
    report = _merge(ep)
    assert (report["chains"], report["completions_merged"], report["chains_cut"]) == (1, 1, 0)


def test_edited_assistant_turn_is_cut_with_its_reason(gw):
    ep, token = make_episode()
    history, answer = _first_turn(gw, token)
    tool = {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": "total 0"}
    history += [_reserialized(answer), tool]
    second = _chat(gw, token, history)  # spliced: extends the chain
    edited = _reserialized(second, dict(ARGS, command="ls"))  # the harness changed what was sampled
    _chat(gw, token, history + [edited, {"role": "tool", "tool_call_id": second["tool_calls"][0]["id"],
                                         "content": "x"}])
    first, _, third = completions(ep)
    # The unchanged older turn is still spliced; the edited one is rendered from its text.
    splice = third.raw_request["splice"]
    assert (splice["completion"], splice["rendered_turns"], splice["miss"]) == (first.id, 1, "turn_not_recorded")
    report = _merge(ep)
    assert (report["chains"], report["completions_merged"]) == (2, 1)
    assert report["chains_cut"] == 1 and report["cut_reasons"] == {"assistant_turn_rerendered": 1}


def test_another_sessions_answer_is_never_spliced(gw):
    ep_a, token_a = make_episode()
    history, answer = _first_turn(gw, token_a)
    (recorded_a,) = completions(ep_a)
    ep_b, token_b = make_episode()  # same history, sent by another episode
    tool = {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": "total 0"}
    _chat(gw, token_b, history + [_reserialized(answer), tool])
    (recorded_b,) = completions(ep_b)
    assert recorded_b.raw_request["splice"]["miss"] == "turn_not_recorded"
    ids, sampled = recorded_b.prompt_ids, recorded_a.sampled_ids
    assert not any(ids[i:i + len(sampled)] == sampled for i in range(len(ids) - len(sampled) + 1))


def test_anthropic_history_is_spliced_and_count_tokens_reports_that_prompt(gw):
    ep, token = make_episode()
    headers = {"x-api-key": token, "anthropic-version": "2023-06-01"}
    tools = [{"name": "bash", "input_schema": {"type": "object"}}]
    user = {"role": "user", "content": "go " + directive({"tool_calls": [{"name": "bash", "arguments": ARGS}]})}
    body = {"model": "claude-x", "max_tokens": 256, "tools": tools, "messages": [user]}
    first = httpx.post(f"{gw.gateway_url}/v1/messages", headers=headers, json=body, timeout=30).json()
    (use,) = [b for b in first["content"] if b["type"] == "tool_use"]
    # The SDK sends `input` back as an object: keys in another order, 1.0 as 1, escaped text.
    sent = dict(use, input=json.loads(json.dumps(dict(reversed(list(use["input"].items()))), ensure_ascii=True)))
    history = [user, {"role": "assistant", "content": [sent]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "total 0"}]}]
    counted = httpx.post(f"{gw.gateway_url}/v1/messages/count_tokens", headers=headers,
                         json={"model": "claude-x", "tools": tools, "messages": history}, timeout=30).json()
    second = httpx.post(f"{gw.gateway_url}/v1/messages", headers=headers, json=dict(body, messages=history),
                        timeout=30).json()
    a, b = completions(ep)
    assert b.raw_request["splice"]["completion"] == a.id
    assert b.prompt_ids[:len(a.prompt_ids) + len(a.sampled_ids)] == a.prompt_ids + a.sampled_ids
    assert counted["input_tokens"] == len(b.prompt_ids) == second["usage"]["input_tokens"]


def test_an_earlier_attempts_answer_is_never_spliced(gw):
    from app import db
    from app.tables import Episode
    from app.proxy.sessions import issue_session

    ep, token = make_episode()
    history, answer = _first_turn(gw, token)
    with db.session_scope() as s:  # the episode is retried: a new attempt, a new session token
        s.get(Episode, ep).attempts = 2
        token2 = issue_session(s, ep)
    tool = {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": "total 0"}
    _chat(gw, token2, history + [_reserialized(answer), tool])
    first, second = completions(ep)
    assert (first.attempt, second.attempt) == (1, 2)
    assert second.raw_request["splice"]["miss"] == "turn_not_recorded"
