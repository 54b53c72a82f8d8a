"""OpenAI Chat Completions API <-> internal Chat Completions.

The client API and the engine API are the same family, but the gateway still
normalizes: developer/mid-conversation system text merged into
one leading system message, array tool results (Qwen Code) and images in
tool results, one completion limit, canonical tool-call deltas with
`index`/`id`/`type` on the first fragment, reasoning under both
`reasoning_content` and `reasoning`, vLLM-only fields stripped.
Spec: https://platform.openai.com/docs/api-reference/chat and
openai/openai-python `src/openai/types/chat/*`.
"""
from __future__ import annotations

import time
from typing import Any

from app.proxy import common as c
from app.proxy import errors
from app.proxy.canonical import Result, new_id
from app.proxy.errors import GatewayError
from app.proxy.sse import COMMENT_KEEPALIVE, FrameTemplate, frame

API = "chat"
ERRORS_IN_STREAM = False  # an engine refusal before the first token is a plain HTTP error
_PASS = {"temperature": "temperature", "top_p": "top_p", "presence_penalty": "presence_penalty",
         "frequency_penalty": "frequency_penalty", "seed": "seed", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty"}


def _parts(content: Any, where: str) -> list[dict]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    c.expect(isinstance(content, list), f"{where}: expected a string or a list of parts", where)
    out = []
    for i, p in enumerate(content):
        if isinstance(p, str):
            out.append({"type": "text", "text": p})
            continue
        c.expect(isinstance(p, dict), f"{where}.{i}: expected an object", where)
        t = p.get("type")
        if t in ("text", "input_text", "output_text") and isinstance(p.get("text"), str):
            out.append({"type": "text", "text": p["text"]})
        elif t == "image_url":
            img = p.get("image_url")
            url = img.get("url") if isinstance(img, dict) else img
            c.expect(isinstance(url, str), f"{where}.{i}.image_url.url: expected a string", where)
            media = url.split(";", 1)[0][5:] if url.startswith("data:") else "image (url)"
            out.append(c.image_part(url, media))
        elif t in ("input_audio", "file"):
            out.append({"type": "text", "text": f"[{t} omitted: not supported by this model]"})
        elif t == "refusal" and isinstance(p.get("refusal"), str):
            out.append({"type": "text", "text": p["refusal"]})
    return out


def _tool_calls(calls: Any, where: str) -> list[dict]:
    c.expect(isinstance(calls, list), f"{where}: expected a list", where)
    out = []
    for i, tc in enumerate(calls):
        c.expect(isinstance(tc, dict) and isinstance(tc.get("function"), dict),
                 f"{where}.{i}: expected {{id, type, function:{{name, arguments}}}}", where)
        fn = tc["function"]
        c.expect(isinstance(fn.get("name"), str), f"{where}.{i}.function.name: expected a string", where)
        out.append(c.tool_call(tc.get("id") or f"call_{i}", fn["name"], fn.get("arguments") or "{}"))
    return out


def _messages(messages: Any) -> list[dict]:
    c.expect(isinstance(messages, list) and messages, "messages: expected a non-empty list", "messages")
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        c.expect(isinstance(m, dict), f"{where}: expected an object", "messages")
        role = m.get("role")
        c.expect(role in ("system", "developer", "user", "assistant", "tool", "function"),
                 f"{where}.role: unknown role {role!r}", "messages")
        parts = _parts(m.get("content"), f"{where}.content")
        if role in ("system", "developer"):
            out.append({"role": "system", "content": c.text_of(parts)})
        elif role == "user":
            out.append({"role": "user", "content": c.simplify_content(parts)})
        elif role == "assistant":
            msg: dict = {"role": "assistant", "content": c.text_of(parts) or None}
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
            reasoning = m.get("reasoning") or m.get("reasoning_content")
            if isinstance(reasoning, str) and reasoning:
                msg["reasoning"] = reasoning
            out.append(msg)
        elif role == "tool":
            call_id = m.get("tool_call_id")
            c.expect(isinstance(call_id, str), f"{where}.tool_call_id: expected a string", "messages")
            out.extend(c.tool_result_messages(call_id, parts))
        else:  # legacy `function` role: no call id to pair with
            out.append({"role": "user", "content": f"[result of {m.get('name')}]\n{c.text_of(parts)}"})
    return c.finalize_messages(out)


def _tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    c.expect(isinstance(tools, list), "tools: expected a list", "tools")
    out = []
    for i, t in enumerate(tools):
        c.expect(isinstance(t, dict), f"tools.{i}: expected an object", "tools")
        if t.get("type", "function") != "function":
            continue
        fn = t.get("function")
        c.expect(isinstance(fn, dict) and isinstance(fn.get("name"), str),
                 f"tools.{i}.function.name: expected a string", "tools")
        out.append(c.function_tool(fn["name"], fn.get("description"), fn.get("parameters")))
    return out


def _tool_choice(tc: Any) -> Any:
    if tc is None or tc in ("none", "auto", "required"):
        return tc
    c.expect(isinstance(tc, dict) and isinstance((tc.get("function") or {}).get("name"), str),
             "tool_choice: expected none|auto|required or {type: function, function: {name}}", "tool_choice")
    return {"type": "function", "function": {"name": tc["function"]["name"]}}


def normalize(body: dict, ctx: c.CallContext = c.NO_CONTEXT) -> c.Normalized:
    """A Chat Completions request body -> `Normalized` (GatewayError 400 on bad input); the
    model and stream flag are the body's (`ctx` holds nothing this API reads)."""
    model = body.get("model")
    c.expect(isinstance(model, str) and model, "model: required string", "model")
    stream = c.expect_type(body.get("stream"), bool, "stream") or False
    n = body.get("n")
    c.expect(n in (None, 1), "n: only n=1 is supported by this gateway", "n")
    chat: dict = {"messages": _messages(body.get("messages"))}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        parallel = c.expect_type(body.get("parallel_tool_calls"), bool, "parallel_tool_calls")
        if parallel is not None:  # false: at most one call is shown (`relay.tool_call_limit`)
            chat["parallel_tool_calls"] = parallel
    chat["max_tokens"] = c.limit_tokens(c.positive_int(body.get("max_tokens"), "max_tokens"),
                                        c.positive_int(body.get("max_completion_tokens"), "max_completion_tokens"))
    c.copy_sampling(body, chat, _PASS)
    stop = c.stop_list(body.get("stop"), "stop")
    if stop:
        chat["stop"] = stop
    if isinstance(body.get("response_format"), dict) and body["response_format"].get("type") != "text":
        chat["response_format"] = body["response_format"]
    if isinstance(body.get("chat_template_kwargs"), dict):
        chat["chat_template_kwargs"] = dict(body["chat_template_kwargs"])
    for flag in ("enable_thinking",):  # pi's `thinkingFormat: qwen` sends it top-level
        if isinstance(body.get(flag), bool):
            chat.setdefault("chat_template_kwargs", {})[flag] = body[flag]
    if isinstance(body.get("reasoning_effort"), str):
        chat["reasoning_effort"] = body["reasoning_effort"]
    top = body.get("top_logprobs")
    if top is not None:
        c.expect_type(top, int, "top_logprobs")
        # OpenAI's range; each alternative adds a token's worth to every sampled token's answer
        c.expect(0 <= top <= 20, f"top_logprobs: must be between 0 and 20, got {top}", "top_logprobs")
        chat["top_logprobs"] = top
    opts = body.get("stream_options")
    c.expect_type(opts, dict, "stream_options")
    meta = {"logprobs": bool(body.get("logprobs")),
            "include_usage": bool(opts and opts.get("include_usage"))}
    return c.Normalized(API, chat, model, stream, meta)


# --- answer -------------------------------------------------------------------------------


def _usage(r: Result) -> dict:
    u = {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
         "total_tokens": r.prompt_tokens + r.completion_tokens}
    if r.cached_tokens:
        u["prompt_tokens_details"] = {"cached_tokens": r.cached_tokens}
    return u


def _clean_logprobs(entries: list[dict]) -> list[dict]:
    keep = ("token", "logprob", "bytes", "top_logprobs")
    return [{k: e.get(k) for k in keep if k in e} | {"top_logprobs": e.get("top_logprobs") or []} for e in entries]


def _finish(r: Result) -> str:
    if r.finish_reason == "length":  # also inside a tool call: the cut call must not be run
        return "length"
    if r.tool_calls:
        return "tool_calls"
    return r.finish_reason or "stop"


def response_id() -> str:
    return new_id("chatcmpl-")


def render(r: Result, norm: c.Normalized, resp_id: str) -> dict:
    return _body(r, norm, resp_id, int(time.time()))


def _body(r: Result, norm: c.Normalized, resp_id: str, created: int) -> dict:
    msg: dict = {"role": "assistant", "content": r.text or None}
    if r.refusal:
        msg["refusal"] = r.refusal
    if r.reasoning:
        msg["reasoning_content"] = r.reasoning
        msg["reasoning"] = r.reasoning
    if r.runnable_calls:
        msg["tool_calls"] = [{"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                             for t in r.runnable_calls]
    logprobs = {"content": _clean_logprobs(r.logprobs_content), "refusal": None} if norm.meta.get("logprobs") else None
    return {"id": resp_id, "object": "chat.completion", "created": created, "model": norm.model,
            "choices": [{"index": 0, "message": msg, "logprobs": logprobs, "finish_reason": _finish(r)}],
            "usage": _usage(r)}


class Stream:
    """chat.completion.chunk writer: role chunk, canonical deltas, finish chunk, optional usage
    chunk (`choices: []`), `[DONE]`."""

    def __init__(self, norm: c.Normalized, resp_id: str) -> None:
        self.norm, self.resp_id, self.created = norm, resp_id, int(time.time())
        self.started = False
        self._lp_sent = 0
        self.held: dict | None = None  # the tool call being generated: sent once it is complete
        self.done = False
        self._text_frame: FrameTemplate | None = None  # a text delta without logprobs, by template

    def _text(self, text: str, r: Result) -> bytes:
        """`_chunk({"content": text}, r)`, byte for byte; by template when no logprobs ride along."""
        if self.norm.meta.get("logprobs"):
            return self._chunk({"content": text}, r)
        if self._text_frame is None:
            self._text_frame = FrameTemplate(self._chunk_body({"content": FrameTemplate.slot(0)}, r), None, 1)
        return self._text_frame.render(text)

    def _chunk(self, delta: dict, r: Result, finish: str | None = None) -> bytes:
        return frame(self._chunk_body(delta, r, finish))

    def _chunk_body(self, delta: dict, r: Result, finish: str | None = None) -> dict:
        choice: dict = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if self.norm.meta.get("logprobs") and len(r.logprobs_content) > self._lp_sent:
            choice["logprobs"] = {"content": _clean_logprobs(r.logprobs_content[self._lp_sent:]), "refusal": None}
            self._lp_sent = len(r.logprobs_content)
        body = {"id": self.resp_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.norm.model, "choices": [choice]}
        if self.norm.meta.get("include_usage"):
            body["usage"] = None
        return body

    def opening(self) -> list[bytes]:
        return []

    def keepalive(self) -> bytes:
        return COMMENT_KEEPALIVE  # never a non-JSON data line: the OpenAI SDK would crash on it

    def start(self, r: Result) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        return [self._chunk({"role": "assistant", "content": ""}, r)]

    def _flush(self, r: Result) -> list[bytes]:
        """Send the held tool call whole.  Calls are held until complete so that a call cut off
        by the token limit is never sent: clients run every call they receive."""
        h, self.held = self.held, None
        if h is None:
            return []
        out = [self._chunk({"tool_calls": [{"index": h["k"], "id": h["id"], "type": "function",
                                            "function": {"name": h["name"], "arguments": ""}}]}, r)]
        if h["args"]:
            out.append(self._chunk({"tool_calls": [{"index": h["k"], "function": {"arguments": h["args"]}}]}, r))
        return out

    def on_event(self, ev: tuple, r: Result) -> list[bytes]:
        out = self.start(r)
        kind = ev[0]
        if kind == "tool_args" and self.held is not None and self.held["k"] == ev[1]:
            self.held["args"] += ev[2]
            return out
        out += self._flush(r)
        if kind == "reasoning":
            out.append(self._chunk({"reasoning_content": ev[1], "reasoning": ev[1]}, r))
        elif kind == "text":
            out.append(self._text(ev[1], r))
        elif kind == "refusal":
            out.append(self._chunk({"refusal": ev[1]}, r))
        elif kind == "tool_start":
            _, k, call_id, name = ev
            self.held = {"k": k, "id": call_id, "name": name, "args": ""}
        elif kind == "tool_args":
            out.append(self._chunk({"tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]}, r))
        return out

    def finish(self, r: Result) -> list[bytes]:
        out = self.start(r)
        if r.cut_short:
            self.held = None  # the last call was cut by the token limit: not runnable, not sent
        out += self._flush(r)
        out.append(self._chunk({}, r, _finish(r)))
        if self.norm.meta.get("include_usage"):
            out.append(frame({"id": self.resp_id, "object": "chat.completion.chunk", "created": self.created,
                              "model": self.norm.model, "choices": [], "usage": _usage(r)}))
        out.append(frame("[DONE]"))
        self.done = True
        return out

    def fail(self, err: GatewayError, r: Result) -> list[bytes]:
        self.done = True
        return [frame(error_body(err)), frame("[DONE]")]

    def final_body(self, r: Result) -> dict:
        return _body(r, self.norm, self.resp_id, self.created)


def models_body(model_ids: list[str]) -> dict:
    return c.openai_models_body(model_ids, int(time.time()))


def model_body(model_id: str) -> dict:
    return models_body([model_id])["data"][0]


def count_body(count: int) -> dict:
    raise GatewayError("not_found", "Chat Completions has no token-counting endpoint")


def error_body(err: GatewayError) -> dict:
    return errors.error_body(API, err)


def answer_of(response: dict | None) -> dict | None:
    """The assistant message (engine Chat form) of a recorded Chat Completions answer, read by this
    API's own history reader exactly as the harness's copy of it will be; None when it holds none."""
    if not isinstance(response, dict):
        return None
    msg = ((response.get("choices") or [{}])[0] or {}).get("message")
    return c.answer_turn(lambda: _messages([msg]) if isinstance(msg, dict) else [])
