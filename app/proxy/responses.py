"""OpenAI Responses API <-> internal Chat Completions: this API's module (`app.proxy.apis.ApiModule`).

Spec: https://platform.openai.com/docs/api-reference/responses and
openai/openai-python `src/openai/types/responses/*`; what Codex consumes:
openai/codex `codex-rs/codex-api/src/sse/responses.rs`.

The request side is here (`normalize`, and `answer_of`, which reads a recorded answer back
through the same input reader); the answer side, `render` and the SSE writer `Stream`, is
`app.proxy.responses_output`.

* Tools: flat function tools; `custom` tools become a function with one string
  argument `input` and come back as `custom_tool_call` items; `namespace`
  (MCP) tools are flattened and calls carry `namespace`; built-ins dropped.
* Input: messages, function/custom tool calls and outputs, reasoning items with
  empty summaries or null encrypted content, Codex history items in any
  order, unknown items ignored.
* Stream: every event has `type` and an increasing `sequence_number`; items are
  opened and closed one at a time; ids are the same in `.added`, `.done` and the
  final response; the stream always ends with `response.completed`,
  `response.incomplete` or `response.failed`.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from app.proxy import common as c
from app.proxy import errors
from app.proxy.canonical import new_id
from app.proxy.errors import GatewayError
from app.proxy.responses_output import Stream, render  # noqa: F401  (this API's names, `app.proxy.apis.ApiModule`)

API = "responses"
# Codex reads errors from the stream: an engine refusal before the first token is answered
# 200 with response.created, then response.failed.
ERRORS_IN_STREAM = True
log = logging.getLogger("turnstile.gateway")
_DROPPED_ITEMS = {"web_search_call", "item_reference", "image_generation_call", "file_search_call",
                  "compaction", "compaction_summary", "mcp_list_tools", "mcp_approval_request",
                  "mcp_approval_response", "computer_call", "computer_call_output", "code_interpreter_call"}


# --- request ------------------------------------------------------------------------------


def _parts(content: Any, where: str) -> list[dict]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    c.expect(isinstance(content, list), f"{where}: expected a string or a list of parts", "input")
    out = []
    for i, p in enumerate(content):
        c.expect(isinstance(p, dict), f"{where}.{i}: expected an object", "input")
        t = p.get("type")
        if t in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            if isinstance(p.get("text"), str) and p["text"]:
                out.append({"type": "text", "text": p["text"]})
        elif t == "refusal" and isinstance(p.get("refusal"), str):
            out.append({"type": "text", "text": p["refusal"]})
        elif t == "input_image":
            url = p.get("image_url")
            out.append(c.image_part(url, "image") if isinstance(url, str)
                       else {"type": "text", "text": "[image omitted: file reference]"})
        elif t == "input_file":
            out.append({"type": "text", "text": f"[file omitted: {p.get('filename') or p.get('file_id')}]"})
    return out


def _output_text(output: Any, where: str) -> list[dict]:
    if isinstance(output, str):
        return [{"type": "text", "text": output}]
    if isinstance(output, list):
        return _parts(output, where)
    return [{"type": "text", "text": json.dumps(output)}] if output is not None else []


def _messages(items: Any, custom_tools: set[str]) -> list[dict]:
    """Responses input items -> Chat messages (before `finalize_messages`)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    c.expect(isinstance(items, list), "input: expected a string or a list of items", "input")
    out: list[dict] = []
    pending_reasoning: list[str] = []

    def assistant(msg: dict) -> None:
        if pending_reasoning:
            msg["reasoning"] = "".join(pending_reasoning)
            pending_reasoning.clear()
        out.append(msg)

    for i, it in enumerate(items):
        where = f"input.{i}"
        c.expect(isinstance(it, dict), f"{where}: expected an object", "input")
        t = it.get("type") or ("message" if "role" in it else None)
        if t == "message":
            role = it.get("role")
            c.expect(role in ("user", "assistant", "system", "developer"), f"{where}.role: unknown role {role!r}",
                     "input")
            parts = _parts(it.get("content"), f"{where}.content")
            if role == "assistant":
                assistant({"role": "assistant", "content": c.text_of(parts) or None})
            elif role in ("system", "developer"):
                out.append({"role": "system", "content": c.text_of(parts)})
            else:
                out.append({"role": "user", "content": c.simplify_content(parts)})
        elif t in ("function_call", "custom_tool_call", "local_shell_call"):
            call_id = it.get("call_id") or it.get("id")
            c.expect(isinstance(call_id, str), f"{where}.call_id: expected a string", "input")
            if t == "function_call":
                name, args = it.get("name"), it.get("arguments") or "{}"
            elif t == "custom_tool_call":
                name, args = it.get("name"), json.dumps({"input": it.get("input") or ""}, ensure_ascii=False)
            else:
                name, args = "local_shell", json.dumps(it.get("action") or {}, ensure_ascii=False)
            c.expect(isinstance(name, str), f"{where}.name: expected a string", "input")
            assistant({"role": "assistant", "content": None, "tool_calls": [c.tool_call(call_id, name, args)]})
        elif t in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            call_id = it.get("call_id") or it.get("id")
            c.expect(isinstance(call_id, str), f"{where}.call_id: expected a string", "input")
            out.extend(c.tool_result_messages(call_id, _output_text(it.get("output"), f"{where}.output")))
        elif t == "reasoning":
            # summary may be [], encrypted_content null; restore our own encrypted content.
            text = c.reasoning_from_signature(it.get("encrypted_content"), f"{where}.encrypted_content")
            if text is None:
                parts = _parts(it.get("content") or [], f"{where}.content") or \
                    _parts(it.get("summary") or [], f"{where}.summary")
                text = c.text_of(parts)
            if text:
                pending_reasoning.append(text)
        elif t in _DROPPED_ITEMS or t is not None:
            log.info("responses: ignoring input item of type %r", t)
        else:
            raise GatewayError("invalid_request", f"{where}: item without a type", param="input")
    return out


def _tools(tools: Any, meta: dict) -> list[dict]:
    if tools is None:
        return []
    c.expect(isinstance(tools, list), "tools: expected a list", "tools")
    out: list[dict] = []
    for i, t in enumerate(tools):
        c.expect(isinstance(t, dict), f"tools.{i}: expected an object", "tools")
        typ = t.get("type")
        if typ == "function":
            c.expect(isinstance(t.get("name"), str), f"tools.{i}.name: expected a string", "tools")
            out.append(c.function_tool(t["name"], t.get("description"), t.get("parameters")))
        elif typ == "custom":  # freeform tool -> one string argument
            c.expect(isinstance(t.get("name"), str), f"tools.{i}.name: expected a string", "tools")
            meta["custom_tools"].append(t["name"])
            desc = (t.get("description") or "") + "\nPass the complete raw input as the string argument `input`."
            out.append(c.function_tool(t["name"], desc.strip(), {
                "type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}))
        elif typ == "namespace":
            for sub in t.get("tools") or []:
                if isinstance(sub, dict) and sub.get("type") == "function" and isinstance(sub.get("name"), str):
                    meta["namespaces"].setdefault(sub["name"], t.get("name"))
                    out.append(c.function_tool(sub["name"], sub.get("description"), sub.get("parameters")))
        # web_search, image_generation, file_search, ...: built-ins the local model cannot run
    return out


def _tool_choice(tc: Any) -> Any:
    if tc is None or tc in ("none", "auto", "required"):
        return tc
    c.expect(isinstance(tc, dict), "tool_choice: expected none|auto|required or an object", "tool_choice")
    if tc.get("type") in ("function", "custom") and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}
    return "auto"


def _history(body: dict, ctx: c.CallContext) -> list | None:
    """The input items `previous_response_id` stands for (`ctx.history`), None without one."""
    prev = body.get("previous_response_id")
    if prev is None:
        return None
    if not isinstance(prev, str):
        raise GatewayError("invalid_request", "previous_response_id: expected a string", param="previous_response_id")
    if ctx.history is None:
        return None
    try:
        return ctx.history(prev)
    except LookupError:
        raise GatewayError("invalid_request", f"Previous response with id '{prev}' not found.",
                           param="previous_response_id") from None


def normalize(body: dict, ctx: c.CallContext = c.NO_CONTEXT) -> c.Normalized:
    """A Responses request (+ the items of the previous responses it names, read through
    `ctx.history`) -> `Normalized` (GatewayError 400 on bad input)."""
    history = _history(body, ctx)
    model = body.get("model")
    c.expect(isinstance(model, str) and model, "model: required string", "model")
    stream = c.expect_type(body.get("stream"), bool, "stream") or False
    meta: dict = {"custom_tools": [], "namespaces": {}, "request": {
        k: body.get(k) for k in ("instructions", "tools", "tool_choice", "parallel_tool_calls", "temperature",
                                 "top_p", "max_output_tokens", "previous_response_id", "reasoning", "store",
                                 "text", "metadata")}}
    instructions = c.expect_type(body.get("instructions"), str, "instructions")
    c.expect("input" in body, "input: required", "input")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    tools = _tools(body.get("tools"), meta)
    custom = set(meta["custom_tools"])
    if history:
        messages += _messages(history, custom)
    messages += _messages(body.get("input"), custom)
    chat: dict = {"messages": c.finalize_messages(messages)}
    if tools:
        chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        parallel = c.expect_type(body.get("parallel_tool_calls"), bool, "parallel_tool_calls")
        if parallel is not None:  # false: at most one call is shown (`relay.tool_call_limit`)
            chat["parallel_tool_calls"] = parallel
    chat["max_tokens"] = c.limit_tokens(c.positive_int(body.get("max_output_tokens"), "max_output_tokens"))
    c.copy_sampling(body, chat, {"temperature": "temperature", "top_p": "top_p"})
    reasoning = c.expect_type(body.get("reasoning"), dict, "reasoning")
    if reasoning is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": reasoning.get("effort") not in ("none", "minimal")}
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name") or "output", "schema": fmt["schema"], "strict": bool(fmt.get("strict"))}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return c.Normalized(API, chat, model, stream, meta)


# --- answer: ids, model lists, errors, recorded answers read back ------------------------


def response_id() -> str:
    return new_id("resp_")


def models_body(model_ids: list[str]) -> dict:
    return c.openai_models_body(model_ids, int(time.time()))


def model_body(model_id: str) -> dict:
    return models_body([model_id])["data"][0]


def count_body(count: int) -> dict:
    raise GatewayError("not_found", "The gateway offers no token counting for the Responses API")


def error_body(err: GatewayError) -> dict:
    return errors.error_body(API, err)


def answer_of(response: dict | None) -> dict | None:
    """The assistant message (engine Chat form) of a recorded Responses answer, read by this API's
    own history reader exactly as the harness's copy of it will be; None when it holds none."""
    if not isinstance(response, dict):
        return None
    return c.answer_turn(lambda: c.finalize_messages(_messages(list(response.get("output") or []), set())))
