"""One-turn calls through the real SDK clients (anthropic, openai Chat and Responses, google-genai),
streaming or not, with the answer reduced to one shape for comparisons across the four APIs."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SdkAnswer:
    stop: str                                   # stop_reason / finish_reason / status / finishReason
    text: str = ""
    calls: list = field(default_factory=list)   # [(id, name, raw arguments: str | dict)]
    usage: dict = field(default_factory=dict)   # the API's own usage fields
    extra: dict = field(default_factory=dict)   # API-specific facts (incomplete reason, events...)


def _tool_specs(api: str, names: list[str]):
    schema = {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}
    if api == "anthropic":
        return [{"name": n, "description": n, "input_schema": schema} for n in names]
    if api == "chat":
        return [{"type": "function", "function": {"name": n, "parameters": schema}} for n in names]
    if api == "responses":
        return [{"type": "function", "name": n, "parameters": schema} for n in names]
    from google.genai import types
    return [types.Tool(function_declarations=[types.FunctionDeclaration(name=n, description=n,
                                                                         parameters_json_schema=schema)
                                              for n in names])]


def sdk_ask(sdk, token: str, api: str, stream: bool, text: str, tools: list[str] | None = None,
            limit: int | None = None, messages: list | None = None) -> SdkAnswer:
    """Ask `text` (or send `messages` in the API's own form) through the real SDK of `api`."""
    specs = _tool_specs(api, tools) if tools else None
    if api == "anthropic":
        client = sdk.anthropic(token, max_retries=0)
        kw = dict(model="claude-turnstile", max_tokens=limit or 500,
                  messages=messages or [{"role": "user", "content": text}])
        if specs:
            kw["tools"] = specs
        if stream:
            with client.messages.stream(**kw) as s:
                start_usage = None
                for ev in s:
                    if ev.type == "message_start":
                        start_usage = ev.message.usage.model_dump()
                msg = s.get_final_message()
        else:
            msg, start_usage = client.messages.create(**kw), None
        return SdkAnswer(msg.stop_reason, "".join(b.text for b in msg.content if b.type == "text"),
                         [(b.id, b.name, b.input) for b in msg.content if b.type == "tool_use"],
                         msg.usage.model_dump(), {"start_usage": start_usage})
    if api == "chat":
        client = sdk.openai(token, max_retries=0)
        kw = dict(model="gpt-t", messages=messages or [{"role": "user", "content": text}])
        if limit:
            kw["max_tokens"] = limit
        if specs:
            kw["tools"] = specs
        if not stream:
            r = client.chat.completions.create(**kw)
            m = r.choices[0].message
            return SdkAnswer(r.choices[0].finish_reason, m.content or "",
                             [(t.id, t.function.name, t.function.arguments) for t in m.tool_calls or []],
                             r.usage.model_dump())
        out, calls, finish, usage = "", {}, None, {}
        for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
            if ch.usage:
                usage = ch.usage.model_dump()
            for c in ch.choices:
                out += c.delta.content or ""
                for t in c.delta.tool_calls or []:
                    e = calls.setdefault(t.index, [None, None, ""])
                    e[0] = e[0] or t.id
                    e[1] = e[1] or (t.function.name if t.function else None)
                    e[2] += (t.function.arguments or "") if t.function else ""
                finish = c.finish_reason or finish
        return SdkAnswer(finish, out, [tuple(calls[k]) for k in sorted(calls)], usage)
    if api == "responses":
        client = sdk.openai(token, max_retries=0)
        kw = dict(model="gpt-t", input=messages or text)
        if limit:
            kw["max_output_tokens"] = limit
        if specs:
            kw["tools"] = specs
        events = []
        if stream:
            for ev in client.responses.create(stream=True, **kw):
                events.append(ev.type)
                if ev.type in ("response.completed", "response.incomplete", "response.failed"):
                    r = ev.response
        else:
            r = client.responses.create(**kw)
        calls = [(o.call_id, o.name, o.arguments) for o in r.output if o.type == "function_call"]
        return SdkAnswer(r.status, r.output_text, calls, r.usage.model_dump() if r.usage else {},
                         {"incomplete": r.incomplete_details and r.incomplete_details.reason, "events": events,
                          "call_status": [o.status for o in r.output if o.type == "function_call"],
                          "id": r.id})
    from google.genai import types
    client = sdk.gemini(token)
    config = types.GenerateContentConfig(tools=specs, max_output_tokens=limit)
    contents = messages or [types.Content(role="user", parts=[types.Part(text=text)])]
    chunks = ([client.models.generate_content(model="gemini-t", contents=contents, config=config)] if not stream
              else list(client.models.generate_content_stream(model="gemini-t", contents=contents, config=config)))
    out, thoughts, calls, finish, usage = "", "", [], None, {}
    for r in chunks:
        for cand in r.candidates or []:
            for p in (cand.content.parts if cand.content and cand.content.parts else []):
                if p.thought:
                    thoughts += p.text or ""
                else:
                    out += p.text or ""
                if p.function_call:
                    calls.append((p.function_call.id, p.function_call.name, p.function_call.args))
            finish = cand.finish_reason or finish
        if r.usage_metadata:
            usage = r.usage_metadata.model_dump(exclude_none=True)
    return SdkAnswer(finish.value if finish else None, out, calls, usage, {"thoughts": thoughts})
