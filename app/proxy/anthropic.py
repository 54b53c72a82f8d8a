"""Anthropic Messages API <-> internal Chat Completions.

Spec: https://docs.anthropic.com/en/api/messages and /messages-streaming;
types in anthropics/anthropic-sdk-python `src/anthropic/types/*`.
Handled here: block discipline (one block open at a time, each tool call its own block),
thinking deltas with signatures, thinking kept in history, unknown betas and cache_control
ignored, system arrays and mid-conversation system messages, images in tool results,
stop_sequence reporting, thinking off unless asked, no empty text blocks (refusals shown as
text), tool-only assistant turns.
"""
from __future__ import annotations

import time
from typing import Any

from app.proxy import common as c
from app.proxy.canonical import Result, new_id
from app.proxy import errors
from app.proxy.errors import GatewayError
from app.proxy.sse import FrameTemplate, frame

API = "anthropic"
ERRORS_IN_STREAM = False  # an engine refusal before the first token is a plain HTTP error
_KNOWN_SERVER_TOOL_PREFIXES = ("web_search", "web_fetch", "bash_", "text_editor", "computer_", "code_execution",
                               "memory_", "tool_search", "mcp")


# --- request ------------------------------------------------------------------------------


def _blocks(content: Any, where: str) -> list[dict]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    c.expect(isinstance(content, list), f"{where}: expected a string or a list of content blocks", where)
    for i, b in enumerate(content):
        c.expect(isinstance(b, dict) and isinstance(b.get("type"), str),
                 f"{where}.{i}: each content block must be an object with a string 'type'", where)
        for key in ("text", "thinking"):  # the text of text and thinking blocks is a string (or absent)
            if b["type"] == key:
                c.expect(b.get(key) is None or isinstance(b[key], str), f"{where}.{i}.{key}: expected a string", where)
    return content


def _image(block: dict) -> dict:
    src = block.get("source") or {}
    if src.get("type") == "base64":
        data = src.get("data") or ""
        return c.image_part(c.data_url(src.get("media_type") or "image/png", data),
                            src.get("media_type") or "image", len(data) * 3 // 4)
    if src.get("type") == "url":
        return c.image_part(src.get("url") or "", "image (url)")
    return {"type": "text", "text": "[image omitted: unsupported source]"}


def _user_parts(block: dict) -> list[dict]:
    t = block["type"]
    if t == "text":
        return [{"type": "text", "text": block.get("text") or ""}] if block.get("text") else []
    if t == "image":
        return [_image(block)]
    if t == "document":
        src = block.get("source") or {}
        if src.get("type") == "text":
            return [{"type": "text", "text": src.get("data") or ""}]
        return [{"type": "text", "text": f"[document omitted: {src.get('media_type') or src.get('type')}]"}]
    if t == "search_result":
        texts = [b.get("text", "") for b in block.get("content") or [] if isinstance(b, dict)]
        return [{"type": "text", "text": f"{block.get('title', '')}\n" + "\n".join(texts)}]
    return []  # server-tool results, container uploads...: nothing the local model can use


def _tool_result(block: dict, i: int) -> list[dict]:
    call_id = block.get("tool_use_id")
    c.expect(isinstance(call_id, str) and call_id, f"messages.{i}: tool_result needs a string tool_use_id")
    parts: list[dict] = []
    for b in _blocks(block.get("content"), f"messages.{i}.tool_result.content"):
        parts.extend(_user_parts(b))
    if block.get("is_error") and parts and parts[0].get("type") == "text":
        parts[0] = {"type": "text", "text": "Error: " + parts[0]["text"]}
    return c.tool_result_messages(call_id, parts)


def _messages(messages: Any) -> list[dict]:
    c.expect(isinstance(messages, list), "messages: expected a list", "messages")
    out: list[dict] = []
    for i, msg in enumerate(messages):
        c.expect(isinstance(msg, dict), f"messages.{i}: expected an object", "messages")
        role = msg.get("role")
        c.expect(role in ("user", "assistant", "system"), f"messages.{i}.role: must be user or assistant", "messages")
        blocks = _blocks(msg.get("content"), f"messages.{i}.content")
        if role == "system":  # mid-conversation system message (Claude Code)
            out.append({"role": "system", "content": c.text_of([b for b in blocks if b["type"] == "text"])})
            continue
        if role == "user":
            tools, parts = [], []
            for b in blocks:
                if b["type"] == "tool_result":
                    tools.extend(_tool_result(b, i))
                elif b["type"] == "system" or b.get("role") == "system":
                    out.append({"role": "system", "content": b.get("text") or ""})
                else:
                    parts.extend(_user_parts(b))
            out.extend(tools)  # tool results first: they answer the previous assistant turn
            if parts:
                out.append({"role": "user", "content": c.simplify_content(parts)})
            continue
        text, reasoning, calls = [], [], []
        for j, b in enumerate(blocks):
            t = b["type"]
            if t == "text" and b.get("text"):
                text.append(b["text"])
            elif t == "thinking":
                # keep reasoning; restore it from a gateway-issued signature when empty.
                restored = b.get("thinking") or c.reasoning_from_signature(
                    b.get("signature"), f"messages.{i}.content.{j}.signature") or ""
                if restored:
                    reasoning.append(restored)
            elif t == "tool_use":
                c.expect(isinstance(b.get("name"), str), f"messages.{i}: tool_use needs a string name")
                calls.append(c.tool_call(b.get("id") or new_id("toolu_"), b["name"], b.get("input") or {}))
        m: dict = {"role": "assistant", "content": "".join(text) or None}
        if calls:
            m["tool_calls"] = calls
        if reasoning:
            m["reasoning"] = "".join(reasoning)
        if m["content"] is None and not calls and not reasoning:
            continue
        out.append(m)
    return out


def _system(system: Any) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    blocks = _blocks(system, "system")
    text = "\n\n".join(b.get("text") or "" for b in blocks if b["type"] == "text" and b.get("text"))  # system arrays: the text blocks, joined
    return [{"role": "system", "content": text}] if text else []


def _tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    c.expect(isinstance(tools, list), "tools: expected a list", "tools")
    out = []
    for i, t in enumerate(tools):
        c.expect(isinstance(t, dict) and isinstance(t.get("name"), str), f"tools.{i}: needs a string name", "tools")
        typ = t.get("type")
        if typ not in (None, "custom") or t.get("defer_loading"):
            continue  # server tools cannot run locally; deferred tools are loaded by ToolSearch later
        schema = t.get("input_schema")
        c.expect(schema is None or isinstance(schema, dict), f"tools.{i}.input_schema: expected an object", "tools")
        out.append(c.function_tool(t["name"], t.get("description"), schema or {"type": "object", "properties": {}}))
    return out


def _tool_choice(tc: Any, chat: dict) -> None:
    if tc is None:
        return
    c.expect(isinstance(tc, dict) and tc.get("type") in ("auto", "any", "none", "tool"),
             "tool_choice: expected {type: auto|any|none|tool}", "tool_choice")
    kind = tc["type"]
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    else:
        c.expect(isinstance(tc.get("name"), str), "tool_choice.name: required for type tool", "tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
    if c.expect_type(tc.get("disable_parallel_tool_use"), bool, "tool_choice.disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False  # at most one call is shown (`relay.tool_call_limit`)


def thinking_enabled(thinking: Any) -> bool:
    """Thinking: absent or {type: disabled} means off; enabled/adaptive means on."""
    if thinking is None:
        return False
    c.expect(isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled", "adaptive"),
             "thinking: expected {type: enabled|disabled|adaptive}", "thinking")
    return thinking["type"] != "disabled"


def normalize(body: dict, ctx: c.CallContext = c.NO_CONTEXT) -> c.Normalized:
    """An Anthropic Messages request body -> `Normalized` (raises GatewayError 400 on bad input).
    `ctx.count_only` (count_tokens): the sampling fields, `max_tokens` included, are not read."""
    model = body.get("model")
    c.expect(isinstance(model, str) and model, "model: required string", "model")
    stream = c.expect_type(body.get("stream"), bool, "stream") or False
    messages = _system(body.get("system")) + _messages(body.get("messages"))
    chat: dict = {"messages": c.finalize_messages(messages)}
    last = chat["messages"][-1] if chat["messages"] else {}
    if last.get("role") == "assistant" and last.get("content") and not last.get("tool_calls"):
        # A final assistant message is a prefill: the answer continues it
        # (https://docs.anthropic.com/en/docs/build-with-claude/prompt-engineering/prefill-claudes-response).
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        _tool_choice(body.get("tool_choice"), chat)
    think = thinking_enabled(body.get("thinking"))
    chat["chat_template_kwargs"] = {"enable_thinking": think}
    if not ctx.count_only:
        max_tokens = c.positive_int(body.get("max_tokens"), "max_tokens")
        chat["max_tokens"] = c.limit_tokens(max_tokens)
        c.copy_sampling(body, chat, {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"})
        stop = c.stop_list(body.get("stop_sequences"), "stop_sequences")
        if stop:
            chat["stop"] = stop
        fmt = (body.get("output_config") or {}).get("format") if isinstance(body.get("output_config"), dict) else None
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": fmt["schema"]}}
    display = (body.get("thinking") or {}).get("display") if isinstance(body.get("thinking"), dict) else None
    return c.Normalized(API, chat, model, stream, {"thinking": think, "thinking_display": display})


# --- answer -------------------------------------------------------------------------------

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}


def _finish(r: Result) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) per SDK `stop_reason.py`; vLLM's string stop_reason is the
    matched stop sequence."""
    if r.stop_sequence is not None and r.finish_reason in (None, "stop"):
        return "stop_sequence", r.stop_sequence
    if r.refusal and not r.text and not r.tool_calls:
        return "refusal", None
    if r.finish_reason == "length":  # also inside a tool call: the cut call must not be run
        return "max_tokens", None
    if r.tool_calls:
        return "tool_use", None
    return _STOP.get(r.finish_reason or "stop", "end_turn"), None


def _usage(r: Result) -> dict:
    cached = min(r.cached_tokens, r.prompt_tokens)
    return {"input_tokens": r.prompt_tokens - cached, "output_tokens": r.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _thinking_block(r: Result, meta: dict) -> dict:
    shown = "" if meta.get("thinking_display") == "omitted" else r.reasoning
    return {"type": "thinking", "thinking": shown, "signature": c.reasoning_signature(r.reasoning)}


def response_id() -> str:
    return new_id("msg_")


def render(r: Result, norm: c.Normalized, resp_id: str) -> dict:
    """Non-stream Messages response for `r`."""
    content: list[dict] = []
    if r.reasoning:
        content.append(_thinking_block(r, norm.meta))
    text = r.text or (r.refusal if not r.tool_calls else "")
    if text:  # never an empty text block
        content.append({"type": "text", "text": text})
    for call in r.runnable_calls:
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": call.parsed_arguments()})
    reason, seq = _finish(r)
    return {"id": resp_id, "type": "message", "role": "assistant", "model": norm.model, "content": content,
            "stop_reason": reason, "stop_sequence": seq, "usage": _usage(r)}


class Stream:
    """Messages SSE writer: message_start, strictly ordered content blocks, message_delta,
    message_stop (docs messages-streaming).  Each block is started before its deltas and
    stopped before the next starts; each tool call gets its own block."""

    def __init__(self, norm: c.Normalized, resp_id: str) -> None:
        self.norm, self.resp_id = norm, resp_id
        self.started = False
        self.index = -1
        self.kind: str | None = None   # kind of the open block: thinking | text | tool
        self.tool_k: int | None = None
        self.held: dict | None = None  # the tool call being generated: sent once it is complete
        self.done = False
        self._text_frame: FrameTemplate | None = None

    def _ev(self, name: str, data: dict) -> bytes:
        data = {"type": name, **data}
        return frame(data, name)

    def _text_delta(self, text: str) -> bytes:
        """The text_delta event of the open block, byte for byte as `_ev` writes it (by template)."""
        if self._text_frame is None:
            slot = FrameTemplate.slot
            self._text_frame = FrameTemplate({"type": "content_block_delta", "index": slot(0),
                                              "delta": {"type": "text_delta", "text": slot(1)}},
                                             "content_block_delta", 2)
        return self._text_frame.render(self.index, text)

    def opening(self) -> list[bytes]:
        return []

    def keepalive(self) -> bytes:
        return self._ev("ping", {})

    def start(self, r: Result) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        msg = {"id": self.resp_id, "type": "message", "role": "assistant", "model": self.norm.model, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {**_usage(r), "output_tokens": 0}}
        return [self._ev("message_start", {"message": msg})]

    def _close(self, r: Result) -> list[bytes]:
        out = []
        if self.kind is None:
            return out
        if self.kind == "thinking":
            out.append(self._ev("content_block_delta", {"index": self.index, "delta": {
                "type": "signature_delta", "signature": c.reasoning_signature(r.reasoning)}}))
        out.append(self._ev("content_block_stop", {"index": self.index}))
        self.kind, self.tool_k = None, None
        return out

    def _open(self, kind: str, block: dict, r: Result) -> list[bytes]:
        out = self._close(r)
        self.index += 1
        self.kind = kind
        out.append(self._ev("content_block_start", {"index": self.index, "content_block": block}))
        return out

    def _flush(self, r: Result) -> list[bytes]:
        """Send the held tool call as one tool_use block.  Calls are held until complete so
        that a call cut off by max_tokens is never sent as a tool_use block to run."""
        h, self.held = self.held, None
        if h is None:
            return []
        out = self._open("tool", {"type": "tool_use", "id": h["id"], "name": h["name"], "input": {}}, r)
        self.tool_k = h["k"]
        if h["args"]:
            out.append(self._ev("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": h["args"]}}))
        return out

    def on_event(self, ev: tuple, r: Result) -> list[bytes]:
        out = self.start(r)
        kind = ev[0]
        if kind == "tool_args" and self.held is not None and self.held["k"] == ev[1]:
            self.held["args"] += ev[2]
            return out
        out += self._flush(r)
        if kind == "reasoning":
            if self.kind != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}, r)
            if self.norm.meta.get("thinking_display") != "omitted":
                out.append(self._ev("content_block_delta", {"index": self.index,
                                                            "delta": {"type": "thinking_delta", "thinking": ev[1]}}))
        elif kind in ("text", "refusal"):
            if kind == "refusal" and (r.text or r.tool_calls):
                return out
            if self.kind != "text":
                out += self._open("text", {"type": "text", "text": ""}, r)
            out.append(self._text_delta(ev[1]))
        elif kind == "tool_start":
            _, k, call_id, name = ev
            out += self._close(r)
            self.held = {"k": k, "id": call_id, "name": name, "args": ""}
        elif kind == "tool_args":
            if self.kind == "tool" and self.tool_k == ev[1]:
                out.append(self._ev("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": ev[2]}}))
            elif "interleaved_tool_args" not in r.flags:
                r.flags.append("interleaved_tool_args")  # cannot reopen a stopped block
        return out

    def finish(self, r: Result) -> list[bytes]:
        if r.cut_short:
            self.held = None  # the last call was cut by max_tokens: not runnable, not sent
        out = self.start(r) + self._flush(r) + self._close(r)
        reason, seq = _finish(r)
        out.append(self._ev("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                              "usage": _usage(r)}))
        out.append(self._ev("message_stop", {}))
        self.done = True
        return out

    def fail(self, err: GatewayError, r: Result) -> list[bytes]:
        """Upstream failure after the 200 status line: error event, then message_stop."""
        self.held = None
        out = self.start(r) + self._close(r)
        etype = "overloaded_error" if err.kind == "overloaded" else (
            "invalid_request_error" if err.kind in ("context_length", "invalid_request") else "api_error")
        message = error_body(err)["error"]["message"]
        out.append(self._ev("error", {"error": {"type": etype, "message": message}}))
        out.append(self._ev("message_stop", {}))
        self.done = True
        return out

    def final_body(self, r: Result) -> dict:
        return render(r, self.norm, self.resp_id)


def models_body(model_ids: list[str]) -> dict:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    data = [{"type": "model", "id": m, "display_name": m, "created_at": now} for m in model_ids]
    return {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


def model_body(model_id: str) -> dict:
    return models_body([model_id])["data"][0]


def count_body(count: int) -> dict:
    """`POST /v1/messages/count_tokens`'s answer (https://docs.anthropic.com/en/api/messages-count-tokens)."""
    return {"input_tokens": count}


def error_body(err: GatewayError) -> dict:
    return errors.error_body(API, err)


def answer_of(response: dict | None) -> dict | None:
    """The assistant message (engine Chat form) of a recorded Messages answer, read by this API's
    own history reader exactly as the harness's copy of it will be; None when it holds none."""
    if not isinstance(response, dict):
        return None
    return c.answer_turn(lambda: c.finalize_messages(_messages(
        [{"role": "assistant", "content": response.get("content") or []}])))
