"""Event-grammar validators for the four streaming APIs (used on every stream in the suite).

Each `validate_*` takes raw SSE bytes, asserts the API's grammar, and returns the
answer rebuilt from the events so tests can compare it with the non-stream answer.
Grammar sources: docs.anthropic.com/en/api/messages-streaming; platform.openai.com
chat streaming and Responses streaming events; ai.google.dev generateContent SSE.
"""
from __future__ import annotations

import json

from app.engines.sse import SSEDecoder


def frames(raw: bytes) -> list[tuple[str | None, str]]:
    dec = SSEDecoder()
    out = dec.feed(raw)
    out += dec.close()
    return out


def validate_anthropic(raw: bytes) -> dict:
    evs = [(e, json.loads(d)) for e, d in frames(raw)]
    evs = [(e, d) for e, d in evs if e != "ping"]
    assert evs, "empty Anthropic stream"
    for e, d in evs:
        assert e == d.get("type"), f"event line {e!r} != data.type {d.get('type')!r}"
    assert evs[0][0] == "message_start", f"first event is {evs[0][0]}"
    msg = evs[0][1]["message"]
    assert msg["content"] == [] and msg["stop_reason"] is None
    assert isinstance(msg["usage"]["input_tokens"], int) and msg["usage"]["input_tokens"] > 0
    assert evs[-1][0] == "message_stop", "stream must end with message_stop"
    blocks: list[dict] = []
    open_idx, signed, deltas = None, False, 0
    stop_reason, errored = None, False
    for i, (e, d) in enumerate(evs[1:-1], start=1):
        assert not errored, f"{e} after error (only message_stop may follow)"
        if e == "content_block_start":
            assert open_idx is None, f"block {d['index']} started while {open_idx} is open"
            assert d["index"] == len(blocks), f"block index {d['index']} != {len(blocks)}"
            block = dict(d["content_block"])
            block["_json"] = ""
            blocks.append(block)
            open_idx, signed, deltas = d["index"], False, 0
        elif e == "content_block_delta":
            assert open_idx is not None and d["index"] == open_idx, f"delta for index {d['index']} not open"
            b, delta = blocks[open_idx], d["delta"]
            allowed = {"text": {"text_delta"}, "tool_use": {"input_json_delta"},
                       "thinking": {"thinking_delta", "signature_delta"}}[b["type"]]
            assert delta["type"] in allowed, f"{delta['type']} in a {b['type']} block"
            if delta["type"] == "text_delta":
                b["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                b["_json"] += delta["partial_json"]
            elif delta["type"] == "thinking_delta":
                assert not signed, "thinking_delta after signature_delta"
                b["thinking"] += delta["thinking"]
            else:
                assert delta["signature"], "empty signature"
                b["signature"] = delta["signature"]
                signed = True
            deltas += 1
        elif e == "content_block_stop":
            assert open_idx is not None and d["index"] == open_idx, "stop for a block that is not open"
            b = blocks[open_idx]
            if b["type"] == "thinking":
                assert signed, "thinking block stopped without a signature_delta"
            if b["type"] == "text":
                assert b["text"], "empty text block"
            if b["type"] == "tool_use":
                try:
                    b["input"] = json.loads(b["_json"]) if b["_json"] else {}
                except ValueError:  # cut by the token limit: allowed only as the last block, max_tokens
                    b["input"], b["_cut"] = None, True
                else:
                    assert isinstance(b["input"], dict), "tool input must be a JSON object"
            open_idx = None
        elif e == "message_delta":
            assert open_idx is None, "message_delta with an open block"
            assert stop_reason is None, "two message_delta events"
            stop_reason = d["delta"]["stop_reason"]
            assert stop_reason in {"end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal",
                                   "model_context_window_exceeded"}
            assert isinstance(d["usage"]["output_tokens"], int)
            usage, seq = d["usage"], d["delta"]["stop_sequence"]
        elif e == "error":
            assert d["error"]["type"] and d["error"]["message"]
            errored = True
        else:
            raise AssertionError(f"unknown event {e}")
    assert open_idx is None, "stream ended with an open block"
    for n, b in enumerate(blocks):
        b.pop("_json", None)
        if b.pop("_cut", False):
            assert n == len(blocks) - 1 and stop_reason == "max_tokens", "unparsable tool input not cut by max_tokens"
    if errored:
        return {"error": True, "content": blocks}
    assert stop_reason is not None, "no message_delta"
    return {"id": msg["id"], "model": msg["model"], "content": blocks, "stop_reason": stop_reason,
            "stop_sequence": seq, "usage": {**msg["usage"], **usage}}


def validate_chat(raw: bytes) -> dict:
    fs = frames(raw)
    assert fs and fs[-1][1] == "[DONE]", "chat stream must end with data: [DONE]"
    for e, _ in fs:
        assert e is None, "chat streams carry no event names"
    chunks = [json.loads(d) for _, d in fs[:-1]]
    if chunks and "error" in chunks[-1]:
        assert chunks[-1]["error"]["message"]
        return {"error": chunks[-1]["error"]}
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1, "chunk ids differ"
    msg: dict = {"role": None, "content": "", "reasoning": "", "tool_calls": []}
    finish, usage, seen_ids = None, None, {}
    for n, c in enumerate(chunks):
        assert c["object"] == "chat.completion.chunk" and "choices" in c
        if not c["choices"]:
            assert finish is not None and c.get("usage"), "choices: [] only for the final usage chunk"
            usage = c["usage"]
            continue
        assert finish is None, "chunk after finish_reason"
        ch = c["choices"][0]
        d = ch["delta"]
        if n == 0:
            assert d.get("role") == "assistant", "first delta must carry role"
            msg["role"] = "assistant"
        msg["content"] += d.get("content") or ""
        msg["reasoning"] += d.get("reasoning_content") or ""
        for tc in d.get("tool_calls") or []:
            assert isinstance(tc.get("index"), int), "tool call fragment without index"
            k = tc["index"]
            if k not in seen_ids:
                assert tc.get("id") and tc.get("type") == "function" and tc["function"].get("name"), \
                    "first fragment needs id, type and name"
                assert k == len(msg["tool_calls"]), "tool call indexes must be consecutive"
                seen_ids[k] = tc["id"]
                msg["tool_calls"].append({"id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
            else:
                assert tc.get("id") in (None, seen_ids[k]), "a later fragment changed the id"
            msg["tool_calls"][k]["arguments"] += tc.get("function", {}).get("arguments") or ""
        if ch.get("finish_reason"):
            finish = ch["finish_reason"]
    assert finish is not None, "no finish_reason"
    runnable = msg["tool_calls"][:-1] if finish == "length" else msg["tool_calls"]  # a length stop cuts the last
    for t in runnable:
        json.loads(t["arguments"])
    return {"message": msg, "finish_reason": finish, "usage": usage}


def validate_responses(raw: bytes) -> dict:
    evs = [(e, json.loads(d)) for e, d in frames(raw)]
    assert len(evs) >= 2
    for n, (e, d) in enumerate(evs):
        assert d["type"] == e, f"event {e} != type {d['type']}"
        assert d["sequence_number"] == n, f"sequence_number {d['sequence_number']} != {n}"
    assert evs[0][0] == "response.created"
    term = evs[-1]
    assert term[0] in ("response.completed", "response.incomplete", "response.failed"), f"ends with {term[0]}"
    done_items: list[dict] = []
    open_item, text, args = None, "", ""
    resp_id = evs[0][1]["response"]["id"]
    for e, d in evs[1:-1]:
        if e == "response.in_progress":
            assert open_item is None and not done_items or True
            continue
        if e == "response.output_item.added":
            assert open_item is None, "item added while another is open"
            assert d["output_index"] == len(done_items)
            open_item, text, args = d["item"], "", ""
            continue
        assert open_item is not None, f"{e} with no open item"
        if "output_index" in d:
            assert d["output_index"] == len(done_items), f"{e}: wrong output_index"
        if "item_id" in d:
            assert d["item_id"] == open_item["id"], f"{e}: item_id differs from the open item"
        if e in ("response.output_text.delta", "response.reasoning_text.delta"):
            text += d["delta"]
        elif e in ("response.output_text.done", "response.reasoning_text.done"):
            assert d["text"] == text, f"{e}: text != concatenated deltas"
        elif e == "response.function_call_arguments.delta":
            args += d["delta"]
        elif e == "response.function_call_arguments.done":
            assert d["arguments"] == args, "arguments.done != concatenated deltas"
        elif e == "response.output_item.done":
            item = d["item"]
            assert item["id"] == open_item["id"] and item["type"] == open_item["type"], "item changed id/type"
            if item["type"] == "function_call":
                assert item["call_id"] == open_item["call_id"] and item["arguments"] == args
                if item["status"] != "incomplete":  # a call cut by the token limit is incomplete
                    json.loads(args)
            done_items.append(item)
            open_item = None
        elif e in ("response.content_part.added", "response.content_part.done",
                   "response.custom_tool_call_input.done", "response.custom_tool_call_input.delta"):
            pass
        else:
            raise AssertionError(f"unexpected event {e}")
    assert open_item is None, "stream ended with an open item"
    final = term[1]["response"]
    assert final["id"] == resp_id
    assert [i["id"] for i in final["output"]] == [i["id"] for i in done_items], "final output != done items"
    assert final["output"] == done_items
    if term[0] == "response.failed":
        assert final["status"] == "failed" and final["error"]["code"] and final["error"]["message"]
    else:
        u = final["usage"]
        assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    return final


def validate_gemini(raw: bytes) -> dict:
    fs = frames(raw)
    assert fs, "empty Gemini stream"
    chunks = []
    for e, d in fs:
        assert e is None, "Gemini SSE carries only data lines"
        assert d != "[DONE]", "Gemini streams have no [DONE]"
        chunks.append(json.loads(d))
    error = None
    parts: list[dict] = []
    finish = usage = None
    for n, c in enumerate(chunks):
        if "error" in c:
            error = c["error"]
            assert c["error"]["status"] and c["error"]["message"]
            continue
        assert finish is None, "chunk after the one carrying finishReason"
        for cand in c.get("candidates") or []:
            for p in (cand.get("content") or {}).get("parts") or []:
                if "text" in p:
                    assert p["text"] != "", "empty text part"
                if "functionCall" in p:
                    assert isinstance(p["functionCall"]["args"], dict) and p["functionCall"]["name"]
                parts.append(p)
            if cand.get("finishReason"):
                finish = cand["finishReason"]
                usage = c.get("usageMetadata")
    assert finish is not None, "no chunk carried finishReason"
    assert usage is not None and usage["totalTokenCount"] == usage["promptTokenCount"] + usage["candidatesTokenCount"]
    text = "".join(p["text"] for p in parts if "text" in p and not p.get("thought"))
    calls = [p["functionCall"] for p in parts if "functionCall" in p]
    return {"text": text, "calls": calls, "finish": finish, "usage": usage, "error": error,
            "thoughts": "".join(p["text"] for p in parts if p.get("thought"))}


VALIDATORS = {"anthropic": validate_anthropic, "chat": validate_chat, "responses": validate_responses,
              "gemini": validate_gemini}


def api_of_path(path: str) -> str:
    if path.endswith("/messages"):
        return "anthropic"
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/responses"):
        return "responses"
    return "gemini"
