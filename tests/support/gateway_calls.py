"""Raw HTTP calls to the gateway in each API's wire format, answers rebuilt into one shape.

`ask(gw, token, api, stream, user_text, ...)` sends a minimal request of `api` and returns
an `Answer` (text, reasoning, tool calls, stop value, usage, raw body); every stream is
checked by the API's grammar validator on the way.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx
from support.gateway_grammar import VALIDATORS

APIS = ["anthropic", "chat", "responses", "gemini"]


@dataclass
class Answer:
    status: int
    text: str = ""
    reasoning: str = ""
    calls: list = field(default_factory=list)   # [(name, args dict)]
    call_ids: list = field(default_factory=list)
    stop: str | None = None
    usage: tuple | None = None                  # (input, output)
    body: dict | None = None
    raw: bytes = b""
    blocks: list = field(default_factory=list)  # Anthropic content blocks / Responses output items


def tools_for(api: str, names: list[str]) -> list[dict]:
    schema = {"type": "object", "properties": {}}
    if api == "anthropic":
        return [{"name": n, "description": n, "input_schema": schema} for n in names]
    if api == "chat":
        return [{"type": "function", "function": {"name": n, "parameters": schema}} for n in names]
    if api == "responses":
        return [{"type": "function", "name": n, "parameters": schema} for n in names]
    return [{"functionDeclarations": [{"name": n, "parameters": {"type": "OBJECT", "properties": {}}}
                                      for n in names]}]


def request_for(api: str, stream: bool, user_text: str, tools: list[str] | None = None,
                extra: dict | None = None) -> tuple[str, dict]:
    """(path, body) of a one-turn request."""
    if api == "anthropic":
        body = {"model": "claude-turnstile", "max_tokens": 500, "messages": [{"role": "user", "content": user_text}]}
        path = "/v1/messages"
    elif api == "chat":
        body = {"model": "gpt-t", "messages": [{"role": "user", "content": user_text}]}
        path = "/v1/chat/completions"
    elif api == "responses":
        body = {"model": "gpt-t", "input": user_text}
        path = "/v1/responses"
    else:
        body = {"contents": [{"role": "user", "parts": [{"text": user_text}]}]}
        path = "/v1beta/models/gemini-t:" + ("streamGenerateContent?alt=sse" if stream else "generateContent")
    if stream and api != "gemini":
        body["stream"] = True
    if tools:
        body["tools"] = tools_for(api, tools)
    body.update(extra or {})
    return path, body


def auth_headers(api: str, token: str) -> dict:
    if api == "anthropic":
        return {"x-api-key": token, "anthropic-version": "2023-06-01"}
    if api == "gemini":
        return {"x-goog-api-key": token}
    return {"authorization": f"Bearer {token}"}


def post(gw, token: str, api: str, path: str, body, headers: dict | None = None) -> httpx.Response:
    h = {**auth_headers(api, token), **(headers or {})}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(gw.gateway_url + path, content=data, headers={"content-type": "application/json", **h},
                      timeout=30)


def parse(api: str, stream: bool, resp: httpx.Response) -> Answer:
    a = Answer(resp.status_code, raw=resp.content)
    if resp.status_code != 200:
        a.body = resp.json()
        return a
    if stream:
        assert resp.headers["content-type"].startswith("text/event-stream")
        rebuilt = VALIDATORS[api](resp.content)
    else:
        rebuilt = resp.json()
    a.body = rebuilt
    if api == "anthropic":
        if rebuilt.get("error"):
            a.stop = "error"
            return a
        a.blocks = rebuilt["content"]
        for b in rebuilt["content"]:
            if b["type"] == "text":
                a.text += b["text"]
            elif b["type"] == "thinking":
                a.reasoning += b["thinking"]
            elif b["type"] == "tool_use":
                a.calls.append((b["name"], b["input"]))
                a.call_ids.append(b["id"])
        a.stop = rebuilt["stop_reason"]
        a.usage = (rebuilt["usage"]["input_tokens"], rebuilt["usage"]["output_tokens"])
    elif api == "chat":
        if "error" in rebuilt:
            a.stop = "error"
            return a
        if stream:
            m, a.stop = rebuilt["message"], rebuilt["finish_reason"]
            calls = [(t["name"], t["arguments"], t["id"]) for t in m["tool_calls"]]
            a.usage = None
        else:
            m, a.stop = rebuilt["choices"][0]["message"], rebuilt["choices"][0]["finish_reason"]
            calls = [(t["function"]["name"], t["function"]["arguments"], t["id"]) for t in m.get("tool_calls") or []]
            a.usage = (rebuilt["usage"]["prompt_tokens"], rebuilt["usage"]["completion_tokens"])
        a.text, a.reasoning = m.get("content") or "", m.get("reasoning_content") or m.get("reasoning") or ""
        a.calls = [(n, json.loads(args or "{}")) for n, args, _ in calls]
        a.call_ids = [i for _, _, i in calls]
    elif api == "responses":
        a.blocks = rebuilt["output"]
        for o in rebuilt["output"]:
            if o["type"] == "message":
                a.text += "".join(p.get("text") or p.get("refusal") or "" for p in o["content"])
            elif o["type"] == "reasoning":
                a.reasoning += "".join(p["text"] for p in o.get("content") or [])
            elif o["type"] == "function_call":
                a.calls.append((o["name"], json.loads(o["arguments"] or "{}")))
                a.call_ids.append(o["call_id"])
            elif o["type"] == "custom_tool_call":
                a.calls.append((o["name"], o["input"]))
                a.call_ids.append(o["call_id"])
        a.stop = rebuilt["status"] if rebuilt["status"] != "failed" else "failed:" + rebuilt["error"]["code"]
        if rebuilt.get("usage"):
            a.usage = (rebuilt["usage"]["input_tokens"], rebuilt["usage"]["output_tokens"])
    else:
        if stream:
            a.text, a.reasoning, a.stop = rebuilt["text"], rebuilt["thoughts"], rebuilt["finish"]
            calls = rebuilt["calls"]
            u = rebuilt["usage"]
            if rebuilt["error"]:
                a.stop = "error"
        else:
            cand = rebuilt["candidates"][0]
            parts = cand["content"]["parts"]
            a.text = "".join(p["text"] for p in parts if "text" in p and not p.get("thought"))
            a.reasoning = "".join(p["text"] for p in parts if p.get("thought"))
            calls = [p["functionCall"] for p in parts if "functionCall" in p]
            a.stop, u = cand["finishReason"], rebuilt["usageMetadata"]
        a.calls = [(c["name"], c["args"]) for c in calls]
        a.call_ids = [c.get("id") for c in calls]
        a.usage = (u["promptTokenCount"], u["candidatesTokenCount"])
    return a


def ask(gw, token: str, api: str, stream: bool, user_text: str, tools: list[str] | None = None,
        extra: dict | None = None, headers: dict | None = None) -> Answer:
    path, body = request_for(api, stream, user_text, tools, extra)
    return parse(api, stream, post(gw, token, api, path, body, headers))
