"""Gemini generateContent API <-> internal Chat Completions.

Spec: https://ai.google.dev/api/generate-content; googleapis/python-genai
`google/genai/types.py`; what Gemini CLI checks: google-gemini/gemini-cli
`packages/core/src/core/geminiChat.ts`.

* Roles user/model; `functionCall` parts -> assistant tool calls;
  `functionResponse` parts -> tool messages (paired by id, else by name).
* `parameters` (OpenAPI subset, upper-case types) and `parametersJsonSchema`
  both become JSON Schema.
* JSON mode (`responseMimeType` + `responseSchema`/`responseJsonSchema`) ->
  `response_format` (Gemini CLI's router needs valid JSON back).
* Thought signatures: an answer that reasoned carries a `thoughtSignature` on its first part
  after the thinking; it holds the reasoning, restored from it when a client sends the turn
  back without its thought parts (`_sign`).
* No parallel-call control: `functionCallingConfig` has modes and allowed names only
  (https://ai.google.dev/api/caching#FunctionCallingConfig), so every call the model makes is
  answered.
* Stream (`?alt=sse`): data-only frames, each a GenerateContentResponse holding
  only new parts; function calls are sent whole; never an empty text part; the
  last frame always carries `finishReason` and `usageMetadata`.
"""
from __future__ import annotations

import json
from typing import Any

from app.proxy import common as c
from app.proxy import errors
from app.proxy.canonical import Result, new_id
from app.proxy.errors import GatewayError
from app.proxy.sse import FrameTemplate, frame

API = "gemini"
ERRORS_IN_STREAM = False  # an engine refusal before the first token is a plain HTTP error
# Gemini CLI rejects (and retries) an answer with neither a function call nor visible text
# ("The model returned reasoning thoughts but no final response text"), and the JS SDK drops
# parts whose text is "": an answer that is only reasoning, or empty, carries this text part.
NO_TEXT = "(no answer)"
_FINISH = {"stop": "STOP", "length": "MAX_TOKENS", "tool_calls": "STOP", "content_filter": "SAFETY"}


def model_from_path(raw: str) -> str:
    return raw[len("models/"):] if raw.startswith("models/") else raw


def json_schema(schema: Any) -> Any:
    """OpenAPI-subset schema with upper-case types -> JSON Schema (types lower-cased)."""
    if isinstance(schema, list):
        return [json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "type" and isinstance(v, str):
            out[k] = v.lower()
        elif k == "nullable":
            continue
        elif k in ("properties", "$defs", "definitions") and isinstance(v, dict):
            out[k] = {name: json_schema(s) for name, s in v.items()}
        else:
            out[k] = json_schema(v)
    return out


def _field(obj: dict, camel: str, snake: str) -> Any:
    """A field by its JSON name or its proto name: proto3 JSON parsers accept both
    (https://protobuf.dev/programming-guides/json/), so Gemini does, and clients use either."""
    value = obj.get(camel)
    return obj.get(snake) if value is None else value


def _response_text(resp: Any) -> str:
    if isinstance(resp, dict) and len(resp) == 1:
        (val,) = resp.values()
        if isinstance(val, str):
            return val
    return json.dumps(resp, ensure_ascii=False)


def _messages(contents: Any) -> list[dict]:
    c.expect(isinstance(contents, list) and contents, "contents: expected a non-empty list", "contents")
    out: list[dict] = []
    pending: dict[str, list[str]] = {}  # function name -> unanswered call ids, for responses without id
    for i, content in enumerate(contents):
        where = f"contents[{i}]"
        c.expect(isinstance(content, dict), f"{where}: expected an object", "contents")
        role = content.get("role") or "user"
        c.expect(role in ("user", "model", "function", "system"), f"{where}.role: must be user or model", "contents")
        parts = content.get("parts") or []
        c.expect(isinstance(parts, list), f"{where}.parts: expected a list", "contents")
        user_parts, tool_msgs, text, reasoning, calls, signed = [], [], [], [], [], []
        for j, p in enumerate(parts):
            c.expect(isinstance(p, dict), f"{where}.parts[{j}]: expected an object", "contents")
            sig = _field(p, "thoughtSignature", "thought_signature")
            if role == "model" and sig is not None:
                signed.append((sig, f"{where}.parts[{j}].thoughtSignature"))
            if "text" in p:
                c.expect(isinstance(p["text"], str), f"{where}.parts[{j}].text: expected a string", "contents")
                if not p["text"]:
                    continue
                if role == "model":
                    if p["text"] == NO_TEXT and not p.get("thought"):
                        continue  # the gateway's own placeholder: the model never sampled it
                    (reasoning if p.get("thought") else text).append(p["text"])
                else:
                    user_parts.append({"type": "text", "text": p["text"]})
            elif "functionCall" in p:
                fc = p["functionCall"]
                c.expect(isinstance(fc, dict) and isinstance(fc.get("name"), str),
                         f"{where}.parts[{j}].functionCall.name: expected a string", "contents")
                call_id = fc.get("id") or f"call_{i}_{j}"
                pending.setdefault(fc["name"], []).append(call_id)
                calls.append(c.tool_call(call_id, fc["name"], fc.get("args") or {}))
            elif "functionResponse" in p:
                fr = p["functionResponse"]
                c.expect(isinstance(fr, dict) and isinstance(fr.get("name"), str),
                         f"{where}.parts[{j}].functionResponse.name: expected a string", "contents")
                waiting = pending.get(fr["name"]) or []
                call_id = fr.get("id") or (waiting[0] if waiting else f"call_{fr['name']}")
                if call_id in waiting:
                    waiting.remove(call_id)
                tool_msgs.extend(c.tool_result_messages(call_id, [{"type": "text",
                                                                   "text": _response_text(fr.get("response"))}]))
            elif "inlineData" in p:
                d = p["inlineData"] or {}
                data = d.get("data") or ""
                user_parts.append(c.image_part(c.data_url(d.get("mimeType") or "image/png", data),
                                               d.get("mimeType") or "image", len(data) * 3 // 4))
            elif "fileData" in p:
                user_parts.append({"type": "text", "text": f"[file omitted: {(p['fileData'] or {}).get('fileUri')}]"})
            # executableCode, codeExecutionResult, thoughtSignature-only parts: nothing to render
        if role == "model" and not reasoning:
            # Gemini CLI drops thought parts from its history and keeps the signatures: the
            # gateway's own restore the reasoning, so the turn renders as it was sampled.
            reasoning = [r for r in (c.reasoning_from_signature(sig, at) for sig, at in signed) if r]
        if role == "system":
            out.append({"role": "system", "content": c.text_of(user_parts)})
        elif role == "model":
            if text or calls or reasoning:
                m: dict = {"role": "assistant", "content": "".join(text) or None}
                if calls:
                    m["tool_calls"] = calls
                if reasoning:
                    m["reasoning"] = "".join(reasoning)
                out.append(m)
        else:
            out.extend(tool_msgs)
            if user_parts:
                out.append({"role": "user", "content": c.simplify_content(user_parts)})
    return out


def _system(si: Any) -> list[dict]:
    if si is None:
        return []
    if isinstance(si, str):
        return [{"role": "system", "content": si}]
    c.expect(isinstance(si, dict), "systemInstruction: expected an object with parts", "systemInstruction")
    texts = [p.get("text") for p in si.get("parts") or [] if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return [{"role": "system", "content": "\n".join(texts)}] if texts else []


def _tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    c.expect(isinstance(tools, list), "tools: expected a list", "tools")
    out = []
    for i, t in enumerate(tools):
        c.expect(isinstance(t, dict), f"tools[{i}]: expected an object", "tools")
        for fd in t.get("functionDeclarations") or t.get("function_declarations") or []:
            c.expect(isinstance(fd, dict) and isinstance(fd.get("name"), str),
                     f"tools[{i}].functionDeclarations: each needs a string name", "tools")
            params = fd.get("parametersJsonSchema") or json_schema(fd.get("parameters"))
            out.append(c.function_tool(fd["name"], fd.get("description"), params))
        # googleSearch, codeExecution, urlContext...: server tools, dropped
    return out


def _tool_config(cfg: Any, chat: dict) -> None:
    fcc = (cfg or {}).get("functionCallingConfig") if isinstance(cfg, dict) else None
    if not isinstance(fcc, dict):
        return
    mode = (fcc.get("mode") or "AUTO").upper()
    allowed = fcc.get("allowedFunctionNames") or []
    if mode == "NONE":
        chat["tool_choice"] = "none"
    elif mode in ("ANY", "VALIDATED"):
        if isinstance(allowed, list) and len(allowed) == 1 and isinstance(allowed[0], str):
            chat["tool_choice"] = {"type": "function", "function": {"name": allowed[0]}}
        else:
            chat["tool_choice"] = "required"
    else:
        chat["tool_choice"] = "auto"


def normalize(body: dict, ctx: c.CallContext = c.NO_CONTEXT) -> c.Normalized:
    """A generateContent body (+ model and stream flag from the path, `ctx`) -> `Normalized`
    (GatewayError 400 on bad input).  `ctx.count_only` (countTokens): the body may wrap the
    request as `generateContentRequest` (https://ai.google.dev/api/tokens#method:-models.counttokens)."""
    if ctx.count_only and isinstance(body.get("generateContentRequest"), dict):
        body = body["generateContentRequest"]
    model, stream = model_from_path(ctx.model), ctx.stream and not ctx.count_only
    messages = _system(body.get("systemInstruction") or body.get("system_instruction"))
    messages += _messages(body.get("contents"))
    chat: dict = {"messages": c.finalize_messages(messages)}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        _tool_config(body.get("toolConfig"), chat)
    gen = c.expect_type(body.get("generationConfig"), dict, "generationConfig") or {}
    count = gen.get("candidateCount")
    c.expect(count in (None, 1), "generationConfig.candidateCount: only 1 is supported", "generationConfig")
    chat["max_tokens"] = c.limit_tokens(c.positive_int(gen.get("maxOutputTokens"), "generationConfig.maxOutputTokens"))
    c.copy_sampling(gen, chat, {"temperature": "temperature", "topP": "top_p", "topK": "top_k", "seed": "seed",
                                "presencePenalty": "presence_penalty", "frequencyPenalty": "frequency_penalty"})
    stop = c.stop_list(gen.get("stopSequences"), "generationConfig.stopSequences")
    if stop:
        chat["stop"] = stop
    schema = gen.get("responseJsonSchema") or gen.get("responseSchema")
    if gen.get("responseMimeType") == "application/json":
        chat["response_format"] = ({"type": "json_schema", "json_schema": {"name": "output",
                                                                          "schema": json_schema(schema)}}
                                   if isinstance(schema, dict) else {"type": "json_object"})
    think = _field(gen, "thinkingConfig", "thinking_config")
    include = False
    if isinstance(think, dict):
        # google-genai (3.3) sends this object's fields by their proto names (`include_thoughts`)
        include = bool(_field(think, "includeThoughts", "include_thoughts"))
        budget = _field(think, "thinkingBudget", "thinking_budget")
        chat["chat_template_kwargs"] = {"enable_thinking": not (budget == 0 and not include)}
    return c.Normalized(API, chat, model, stream, {"include_thoughts": include})


# --- answer -------------------------------------------------------------------------------


def _usage(r: Result) -> dict:
    u = {"promptTokenCount": r.prompt_tokens, "candidatesTokenCount": r.completion_tokens,
         "totalTokenCount": r.prompt_tokens + r.completion_tokens}
    if r.cached_tokens:  # part of promptTokenCount, as Gemini reports it
        u["cachedContentTokenCount"] = min(r.cached_tokens, r.prompt_tokens)
    return u


def _call_part(call) -> dict:
    return {"functionCall": {"id": call.id, "name": call.name, "args": call.parsed_arguments()}}


def _sign(parts: list[dict], reasoning: str) -> list[dict]:
    """`parts` with the answer's thought signature on its first part after the thinking (the first
    non-thought part: a functionCall, a text, or the NO_TEXT placeholder), when it reasoned.

    Gemini returns a `thoughtSignature` on the first functionCall part of a step, or on a part of a
    text answer (https://ai.google.dev/gemini-api/docs/thought-signatures), and clients send it
    back on that part even when they drop the thought parts (Gemini CLI does).  The gateway's
    signature carries the reasoning sampled before it (`common.reasoning_signature_bytes`), which
    `_messages` restores, so with or without splicing the next prompt holds the sampled reasoning.
    On the first non-thought part, not the last: Gemini CLI merges consecutive streamed text parts
    into the first one, keeping only that part's other fields."""
    if not reasoning:
        return parts
    for k, p in enumerate(parts):
        if not p.get("thought"):
            parts[k] = {**p, "thoughtSignature": c.reasoning_signature_bytes(reasoning)}
            break
    return parts


def _finish(r: Result) -> str:
    if r.finish_reason == "length":  # also inside a tool call: the cut call is not sent
        return "MAX_TOKENS"
    return "STOP" if r.tool_calls else _FINISH.get(r.finish_reason or "stop", "OTHER")


def response_id() -> str:
    return new_id("", 10)


def render(r: Result, norm: c.Normalized, resp_id: str) -> dict:
    parts: list[dict] = []
    if r.reasoning and norm.meta.get("include_thoughts"):
        parts.append({"text": r.reasoning, "thought": True})
    text = r.text or (r.refusal if not r.tool_calls else "")
    if text:
        parts.append({"text": text})
    parts.extend(_call_part(t) for t in r.runnable_calls)
    if not any("functionCall" in p or not p.get("thought") for p in parts):
        parts.append({"text": NO_TEXT})
    cand: dict = {"content": {"role": "model", "parts": _sign(parts, r.reasoning)}, "finishReason": _finish(r),
                  "index": 0}
    return {"candidates": [cand], "usageMetadata": _usage(r), "modelVersion": norm.model, "responseId": resp_id}


class Stream:
    """`streamGenerateContent?alt=sse` writer."""

    def __init__(self, norm: c.Normalized, resp_id: str) -> None:
        self.norm, self.resp_id = norm, resp_id
        self.sent_calls = 0
        self.sent_visible = False  # a non-thought text part or a functionCall went out
        self.done = False
        self._text_frame: FrameTemplate | None = None

    def _chunk(self, parts: list[dict], finish: str | None = None, r: Result | None = None) -> bytes:
        return frame(self._chunk_body(parts, finish, r))

    def _chunk_body(self, parts: list[dict], finish: str | None = None, r: Result | None = None) -> dict:
        cand: dict = {"index": 0}
        if parts:
            cand["content"] = {"role": "model", "parts": parts}
        if finish:
            cand["finishReason"] = finish
        body: dict = {"candidates": [cand], "modelVersion": self.norm.model, "responseId": self.resp_id}
        if r is not None:
            body["usageMetadata"] = _usage(r)
        return body

    def opening(self) -> list[bytes]:
        return []

    def keepalive(self) -> bytes:
        # Gemini SDKs parse `data:` lines only (an SSE comment stalls the JS SDK's line regex),
        # so keep-alive is a response with no candidates.
        return frame({"modelVersion": self.norm.model, "responseId": self.resp_id})

    def start(self, r: Result) -> list[bytes]:
        return []

    def _flush_calls(self, r: Result, upto: int) -> list[dict]:
        parts = [_call_part(t) for t in r.tool_calls[self.sent_calls:upto]]
        self.sent_calls = max(self.sent_calls, upto)
        return parts

    def _visible(self, parts: list[dict], r: Result) -> list[dict]:
        """`parts` as sent; the first visible part of the answer carries its thought signature (`_sign`)."""
        if any("functionCall" in p or not p.get("thought") for p in parts):
            if not self.sent_visible:
                parts = _sign(parts, r.reasoning)
            self.sent_visible = True
        return parts

    def on_event(self, ev: tuple, r: Result) -> list[bytes]:
        kind = ev[0]
        if kind == "reasoning" and self.norm.meta.get("include_thoughts"):
            return [self._chunk([{"text": ev[1], "thought": True}])]
        if kind == "text" or (kind == "refusal" and not r.text):
            if not ev[1]:
                return []
            if self.sent_visible:  # a plain text part (the signature rode on the first one): by template
                if self._text_frame is None:
                    self._text_frame = FrameTemplate(self._chunk_body([{"text": FrameTemplate.slot(0)}]), None, 1)
                return [self._text_frame.render(ev[1])]
            return [self._chunk(self._visible([{"text": ev[1]}], r))]
        if kind == "tool_start" and ev[1] > self.sent_calls:
            # the previous call is complete: send it whole (Gemini never streams partial args)
            return [self._chunk(self._visible(self._flush_calls(r, ev[1]), r))]
        return []

    def finish(self, r: Result) -> list[bytes]:
        self.done = True
        parts = self._visible(self._flush_calls(r, len(r.runnable_calls)), r)
        if not self.sent_visible:
            parts = self._visible([{"text": NO_TEXT}], r)
        return [self._chunk(parts, _finish(r), r)]

    def fail(self, err: GatewayError, r: Result) -> list[bytes]:
        self.done = True
        return [frame(error_body(err)), self._chunk([], "OTHER", r)]

    def final_body(self, r: Result) -> dict:
        return render(r, self.norm, self.resp_id)


def models_body(model_ids: list[str]) -> dict:
    return {"models": [{"name": f"models/{m}", "baseModelId": m, "displayName": m, "version": "turnstile",
                        "inputTokenLimit": 0, "outputTokenLimit": 0,
                        "supportedGenerationMethods": ["generateContent", "countTokens"]} for m in model_ids]}


def model_body(model_id: str) -> dict:
    return models_body([model_id])["models"][0]


def count_body(count: int) -> dict:
    """`countTokens`' answer (https://ai.google.dev/api/tokens#response-body)."""
    return {"totalTokens": count}


def error_body(err: GatewayError) -> dict:
    return errors.error_body(API, err)


def answer_of(response: dict | None) -> dict | None:
    """The assistant message (engine Chat form) of a recorded generateContent answer, read by this
    API's own history reader exactly as the harness's copy of it will be; None when it holds none."""
    if not isinstance(response, dict):
        return None
    content = ((response.get("candidates") or [{}])[0] or {}).get("content")
    return c.answer_turn(lambda: c.finalize_messages(_messages([content])) if isinstance(content, dict) else [])
