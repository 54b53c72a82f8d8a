"""A fast, deterministic scripted engine speaking the engine contract.

The contract is OpenAI Chat Completions with vLLM's extensions:
`return_token_ids` (top-level `prompt_token_ids`, per-choice `token_ids`),
`logprobs`, per-choice `stop_reason`, `/tokenize`, `/v1/models` with
`max_model_len`, the Turnstile extension `policy_version`, and `prompt_token_ids` in the
request (a prompt given as ids is used verbatim instead of the rendering).

Everything is derivable so tests can check ids end to end:
  prompt text  = `render_prompt(body)` (a tiny fixed chat template)
  token ids    = `encode(text)`: UTF-8 bytes + OFFSET, one id per byte
  sampled text = `sampled_text(reply)`: `<think>R</think>` + text + `<tool_call>{...}</tool_call>`*
  logprob      = `logprob(position, token_id)`

Replies come from (first match wins):
  1. an inline directive `<<script:BASE64URL(JSON reply)>>` in the conversation (latest message first);
  2. a script file (`--script` / TURNSTILE_SCRIPT): {"default": [reply...], "episodes": {"<id>": [reply...]}},
     consumed in order per episode (header `x-turnstile-episode`), the last reply repeating;
  3. a minimal JSON value when JSON output is requested, else the text "ok".

A reply is a JSON object: text, reasoning, reasoning_field ("reasoning" | "reasoning_content"),
tool_calls [{name, arguments, id?}], refusal, error {status, message}, prefill_delay (after the response
headers, like vLLM), header_delay (before them), slow_first (delay only the first identical request), token_delay (s),
abort_after (chunks, then close without [DONE]), error_after (chunks, then an error chunk),
garbage_after (chunks, then one chunk whose `choices` is not a list; non-stream forms in `non_stream_fault`),
quirk ("no_type" | "repeat_id" | "same_index" | "args_at_end" | "args_in_header"), split_bytes (send SSE bytes in 1-byte
writes that split UTF-8 characters), policy_version, cached_tokens (reported as cached prompt tokens).
Tool calls may carry their own `id` (an engine that numbers calls per answer, `call_0`, reuses ids);
quirk "args_object" sends a call's arguments as a JSON object instead of a string.
Delays watch the connection: a client that closes it aborts the request (like vLLM), and the abort
is listed at GET /_scripted/aborted.  `continue_final_message` continues the last (assistant)
message instead of opening a new one.

Run: `python -m app.engines.scripted --port 8200 [--script FILE] [--max-model-len 8192]`.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

OFFSET = 3
MODEL = "scripted-tiny"
_DIRECTIVE = re.compile(r"<<script:([A-Za-z0-9_\-=]+)>>")


# --- deterministic pieces (tests import these) ----------------------------------------------


def encode(text: str) -> list[int]:
    """Token ids of `text`: its UTF-8 bytes + OFFSET."""
    return [b + OFFSET for b in text.encode("utf-8")]


def logprob(position: int, token_id: int) -> float:
    """Deterministic logprob (nats, < 0) of the sampled token at `position`."""
    return -(((token_id * 31 + position * 7) % 1000) / 1000.0) - 0.001


def directive(reply: dict) -> str:
    """The inline text that makes the scripted engine answer with `reply`."""
    return "<<script:" + base64.urlsafe_b64encode(json.dumps(reply).encode()).decode() + ">>"


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    out = []
    for p in content or []:
        if isinstance(p, dict):
            out.append(p.get("text") if p.get("type") == "text" else f"<{p.get('type')}>")
    return "".join(x for x in out if x)


def render_prompt(body: dict) -> str:
    """The scripted chat template: what the engine 'sees' for a Chat Completions body."""
    parts = []
    if body.get("tools"):
        parts.append("<|tools|>\n" + json.dumps(body["tools"], sort_keys=True, ensure_ascii=False) + "\n")
    messages = body.get("messages") or []
    cont = bool(body.get("continue_final_message")) and bool(messages)
    for i, m in enumerate(messages):
        role = m.get("role")
        head = f"<|{role}|>" + (f"[{m.get('tool_call_id')}]" if role == "tool" else "") + "\n"
        reasoning = m.get("reasoning") or m.get("reasoning_content")
        text = (f"<think>{reasoning}</think>" if reasoning else "") + _content_text(m.get("content"))
        for tc in m.get("tool_calls") or []:
            fn = tc.get("function") or {}
            # Arguments inserted as sent (raw JSON text), the form the engine samples them in: a
            # tool-call turn re-renders to its sampled ids unless the harness rewrote it.
            text += ('<tool_call>{"name": ' + json.dumps(fn.get("name")) + ', "arguments": '
                     + _args_text(fn.get("arguments")) + "}</tool_call>")
        parts.append(head + text + ("" if cont and i == len(messages) - 1 else "\n"))
    if body.get("add_generation_prompt", True) and not cont:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def _args_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args if args is not None else {}, ensure_ascii=False)


def _schema_value(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return {}
    if schema.get("enum"):
        return schema["enum"][0]
    t = schema.get("type")
    if isinstance(t, list):
        t = t[0]
    if t == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        return {k: _schema_value(v) for k, v in props.items()}
    return {"string": "x", "integer": 0, "number": 0, "boolean": False, "array": []}.get(t, None)


# --- planning a reply into token steps ------------------------------------------------------


def plan(reply: dict, body: dict) -> tuple[list[dict], str, Any]:
    """Reply -> (steps, finish_reason, stop_reason).  Each step: {"text": piece, "delta": dict|None}.

    Concatenated step texts == the sampled text; ids of a step == encode(step text).
    """
    thinking = ((body.get("chat_template_kwargs") or {}).get("enable_thinking", True)) is not False
    rfield = reply.get("reasoning_field", "reasoning")
    steps: list[dict] = []
    reasoning = reply.get("reasoning") or ""
    if reasoning and thinking:
        steps.append({"text": "<think>", "delta": None})
        steps += [{"text": ch, "delta": {rfield: ch}} for ch in reasoning]
        steps.append({"text": "</think>", "delta": None})
    text = reply.get("text")
    if text is None and not reply.get("tool_calls") and not reply.get("refusal") and not reasoning:
        fmt = body.get("response_format") or {}
        if fmt.get("type") == "json_schema":
            text = json.dumps(_schema_value((fmt.get("json_schema") or {}).get("schema")))
        elif fmt.get("type") == "json_object":
            text = "{}"
        else:
            text = "ok"
    text = text or ""
    finish, stop_reason = reply.get("finish_reason"), None
    calls = list(reply.get("tool_calls") or [])
    for stop in body.get("stop") or []:
        if stop and stop in text:
            text, finish, stop_reason, calls = text[:text.index(stop)], "stop", stop, []
    steps += [{"text": ch, "delta": {"content": ch}} for ch in text]
    if reply.get("refusal"):
        steps += [{"text": ch, "delta": {"refusal": ch}} for ch in reply["refusal"]]
    seed = hashlib.sha256(render_prompt(body).encode()).hexdigest()[:8]
    for k, call in enumerate(calls):
        cid = call.get("id") or f"call_{seed}_{k}"
        args = _args_text(call.get("arguments"))
        head = '<tool_call>{"name": ' + json.dumps(call["name"]) + ', "arguments": '
        steps.append({"text": head, "delta": {"tool_calls": [{"index": k, "id": cid, "type": "function",
                                                               "function": {"name": call["name"], "arguments": ""}}]},
                      "call": (k, cid, call["name"])})
        for i in range(0, len(args), 3):
            steps.append({"text": args[i:i + 3], "delta": {"tool_calls": [{"index": k, "function": {
                "arguments": args[i:i + 3]}}]}, "call": (k, cid, call["name"])})
        steps.append({"text": "}</tool_call>", "delta": None, "call": (k, cid, call["name"]), "trailer": True})
    if finish is None:
        finish = "tool_calls" if calls else "stop"
    max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        kept, used = [], 0
        for s in steps:
            n = len(s["text"].encode("utf-8"))
            if used + n > max_tokens:
                finish, stop_reason = "length", None
                break
            kept.append(s)
            used += n
        steps = kept
    return steps, finish, stop_reason


def apply_quirk(steps: list[dict], quirk: str | None) -> list[dict]:
    """Re-shape streamed tool-call deltas the way some servers do."""
    if not quirk:
        return steps
    out, held = [], {}
    for s in steps:
        call = s.get("call")
        if call is None:
            out.append(s)
            continue
        k, cid, name = call
        if s.get("trailer"):
            if quirk == "args_at_end" and held.get(k):
                s = {**s, "delta": {"tool_calls": [{"index": k, "function": {"arguments": held[k]}}]}}
            out.append(s)
            continue
        tc = json.loads(json.dumps(s["delta"]["tool_calls"][0]))
        first = "id" in tc
        if quirk == "no_type":
            tc.pop("type", None)
        elif quirk == "repeat_id":
            tc["id"] = cid
        elif quirk == "same_index":
            tc["index"] = 0
        elif quirk == "args_at_end" and not first:
            held[k] = held.get(k, "") + tc["function"]["arguments"]
            out.append({**s, "delta": None})
            continue
        elif quirk == "args_object":  # arguments as a JSON value, all on the first fragment
            if first:
                raw = "".join(x["text"] for x in steps if x.get("call") == call and not x.get("trailer")
                              and "id" not in x["delta"]["tool_calls"][0])
                tc["function"]["arguments"] = json.loads(raw) if raw else {}
            else:
                out.append({**s, "delta": None})
                continue
        elif quirk == "args_in_header":  # all arguments ride on the chunk carrying id + name
            if first:
                tc["function"]["arguments"] = "".join(
                    x["text"] for x in steps if x.get("call") == call and not x.get("trailer")
                    and "id" not in x["delta"]["tool_calls"][0])
            else:
                out.append({**s, "delta": None})
                continue
        out.append({**s, "delta": {"tool_calls": [tc]}})
    return out


# --- the HTTP server --------------------------------------------------------------------------


class Scripted:
    """Engine state: script, per-episode counters, recent requests (for tests)."""

    def __init__(self, script: dict | None = None, max_model_len: int = 8192, model: str = MODEL,
                 policy_version: int | None = None) -> None:
        self.script = script or {}
        self.max_model_len = max_model_len
        self.model = model
        self.policy_version = policy_version
        self.counters: dict[str, int] = {}
        self.requests: list[dict] = []
        self.aborted: list[dict] = []  # requests whose client closed the connection during a delay
        self.lock = threading.Lock()

    def reply_for(self, body: dict, episode: str | None) -> dict:
        for m in reversed(body.get("messages") or []):
            found = _DIRECTIVE.findall(_content_text(m.get("content")))
            if found:
                return json.loads(base64.urlsafe_b64decode(found[-1]))
        replies = (self.script.get("episodes") or {}).get(episode or "") or self.script.get("default")
        if replies:
            with self.lock:
                n = self.counters.get(episode or "", 0)
                self.counters[episode or ""] = n + 1
            return replies[min(n, len(replies) - 1)]
        return {}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "ScriptedServer"

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, *args) -> None:  # quiet
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        st = self.server.state
        if self.path.startswith("/v1/models"):
            body = {"object": "list", "data": [{"id": st.model, "object": "model", "owned_by": "turnstile-scripted",
                                                "max_model_len": st.max_model_len}]}
            self._json(200, body)
        elif self.path.startswith("/_scripted/requests"):
            with st.lock:
                self._json(200, {"requests": list(st.requests)})
        elif self.path.startswith("/_scripted/aborted"):
            with st.lock:
                self._json(200, {"aborted": list(st.aborted)})
        elif self.path.startswith("/health"):
            self._json(200, {"status": "ok"})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}", "type": "NotFoundError", "code": 404}})

    def do_POST(self) -> None:
        st = self.server.state
        n = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(n)
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return self._json(400, {"error": {"message": "invalid JSON", "type": "BadRequestError", "code": 400}})
        if self.path.startswith("/_scripted/reset"):
            with st.lock:
                st.requests.clear()
                st.counters.clear()
                st.aborted.clear()
            return self._json(200, {"ok": True})
        with st.lock:
            st.requests.append({"path": self.path, "headers": dict(self.headers.items()), "body": body})
            del st.requests[:-200]
        if self.path.startswith("/tokenize"):
            text = render_prompt(body) if "messages" in body else str(body.get("prompt", ""))
            ids = encode(text)
            return self._json(200, {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids})
        if not self.path.startswith("/v1/chat/completions"):
            return self._json(404, {"error": {"message": f"no route {self.path}", "type": "NotFoundError",
                                              "code": 404}})
        if body.get("model") != st.model:
            return self._json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                              "type": "NotFoundError", "code": 404}})
        self.complete(body)

    def complete(self, body: dict) -> None:
        st = self.server.state
        reply = st.reply_for(body, self.headers.get("x-turnstile-episode"))
        if reply.get("error"):
            err = reply["error"]
            return self._json(int(err.get("status", 500)), {"error": {"message": err.get("message", "scripted error"),
                                                                      "type": "BadRequestError",
                                                                      "code": int(err.get("status", 500))}})
        given = body.get("prompt_token_ids")  # tokens in: a prompt given as ids replaces the rendering
        if given is not None and not (isinstance(given, list) and given and all(
                isinstance(t, int) and not isinstance(t, bool) and OFFSET <= t < OFFSET + 256 for t in given)):
            return self._json(400, {"error": {"message": "'prompt_token_ids' must be a non-empty list of valid "
                                                         "token ids", "type": "BadRequestError", "code": 400}})
        prompt_ids = list(given) if given is not None else encode(render_prompt(body))
        p, limit = len(prompt_ids), st.max_model_len
        max_tokens = body.get("max_tokens")
        if p >= limit:
            msg = (f"This model's maximum context length is {limit} tokens. However, your request has {p} input "
                   f"tokens. Please reduce the length of the input messages.")
            return self._json(400, {"error": {"message": msg, "type": "BadRequestError", "code": 400}})
        if max_tokens is not None and p + max_tokens > limit:
            msg = (f"This model's maximum context length is {limit} tokens. However, you requested "
                   f"{p + max_tokens} tokens ({p} in the messages, {max_tokens} in the completion). "
                   f"Please reduce the length of the messages or completion.")
            return self._json(400, {"error": {"message": msg, "type": "BadRequestError", "code": 400}})
        body = dict(body, max_tokens=max_tokens if max_tokens is not None else limit - p)
        steps, finish, stop_reason = plan(reply, body)
        if body.get("stream"):
            steps = apply_quirk(steps, reply.get("quirk"))
        version = reply.get("policy_version", st.policy_version)
        extra = {"policy_version": version} if version is not None else {}
        if reply.get("slow_first"):  # only the first request with this exact body is slow (retry tests)
            key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
            with st.lock:
                seen = st.counters.get(key, 0)
                st.counters[key] = seen + 1
            if seen == 0:
                time.sleep(float(reply["slow_first"]))
        if reply.get("header_delay"):  # a server that answers nothing at all while it prefills
            self._wait(float(reply["header_delay"]))
        if reply.get("prefill_delay") and not body.get("stream"):
            self._wait(float(reply["prefill_delay"]))
        if body.get("stream"):
            return self.stream(body, reply, steps, finish, stop_reason, prompt_ids, extra)
        try:
            if self.non_stream_fault(reply, steps):
                return
        except ConnectionError:  # the client left during the delay (listed as aborted)
            self.close_connection = True
            return
        ids, lps, content, reasoning, refusal, calls = [], [], "", "", "", {}
        for s in steps:
            for t in encode(s["text"]):
                lps.append({"token": f"token_id:{t}", "logprob": logprob(len(ids), t), "bytes": [t - OFFSET],
                            "top_logprobs": []})
                ids.append(t)
            d = s.get("delta") or {}
            content += d.get("content", "")
            refusal += d.get("refusal", "")
            reasoning += d.get("reasoning", "") + d.get("reasoning_content", "")
            for tc in d.get("tool_calls") or []:
                if s.get("call"):
                    k, cid, name = s["call"]
                    entry = calls.setdefault(k, {"id": cid, "type": "function",
                                                 "function": {"name": name, "arguments": ""}})
                    entry["function"]["arguments"] += (tc.get("function") or {}).get("arguments", "")
        msg: dict = {"role": "assistant", "content": content or None, "tool_calls": [calls[k] for k in sorted(calls)]}
        if reasoning:
            msg[reply.get("reasoning_field", "reasoning")] = reasoning
        if refusal:
            msg["refusal"] = refusal
        usage = {"prompt_tokens": p, "completion_tokens": len(ids), "total_tokens": p + len(ids)}
        if reply.get("cached_tokens"):
            usage["prompt_tokens_details"] = {"cached_tokens": int(reply["cached_tokens"])}
        self._json(200, {"id": "chatcmpl-scripted", "object": "chat.completion", "created": int(time.time()),
                         "model": st.model, "prompt_token_ids": prompt_ids, **extra,
                         "choices": [{"index": 0, "message": msg,
                                      "logprobs": {"content": lps} if body.get("logprobs") else None,
                                      "finish_reason": finish, "stop_reason": stop_reason,
                                      "token_ids": ids if body.get("return_token_ids") else None}],
                         "usage": usage})

    def non_stream_fault(self, reply: dict, steps: list) -> bool:
        """A non-stream answer takes `token_delay` per step (watching the connection), and the
        stream faults have non-stream forms: `abort_after` closes the connection without an
        answer, `garbage_after` answers `choices` that are not a list, `error_after` answers a
        500.  True when the fault was sent (nothing more to send)."""
        cut = [int(reply[k]) for k in ("abort_after", "garbage_after", "error_after") if reply.get(k) is not None]
        n = min([len(steps), *cut])
        if reply.get("token_delay"):
            self._wait(float(reply["token_delay"]) * n)
        if n == len(steps):  # no fault before the last step
            return False
        if reply.get("abort_after") is not None and int(reply["abort_after"]) == n:
            self.close_connection = True  # no status line at all
            return True
        if reply.get("garbage_after") is not None and int(reply["garbage_after"]) == n:
            self._json(200, {"id": "chatcmpl-scripted", "object": "chat.completion", "choices": "not a list"})
            return True
        self._json(500, {"error": {"message": "scripted failure", "type": "InternalServerError", "code": 500}})
        return True

    def _wait(self, seconds: float) -> None:
        """Sleep `seconds`, watching the connection: EOF from the client aborts the request."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            readable, _, _ = select.select([self.connection], [], [], min(left, 0.02))
            if not readable:
                continue
            try:
                closed = self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                closed = True
            if not closed:
                time.sleep(min(left, 0.02))
                continue
            st = self.server.state
            with st.lock:
                st.aborted.append({"at": time.time(), "episode": self.headers.get("x-turnstile-episode")})
            self.close_connection = True
            raise ConnectionAbortedError("client closed the connection")

    def _chunk(self, data: bytes, split: bool) -> None:
        if not split:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            return
        for i in range(len(data)):  # one byte per HTTP chunk: multi-byte characters arrive split
            self.wfile.write(b"1\r\n%s\r\n" % data[i:i + 1])
            if data[i] >= 0x80:
                self.wfile.flush()
                time.sleep(0.0005)

    def stream(self, body, reply, steps, finish, stop_reason, prompt_ids, extra) -> None:
        st = self.server.state
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        split = bool(reply.get("split_bytes"))
        delay = float(reply.get("token_delay") or 0)
        base = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": st.model}

        opts = body.get("stream_options") or {}
        cached = int(reply.get("cached_tokens") or 0)

        def usage(completion: int) -> dict:
            u = {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
                 "total_tokens": len(prompt_ids) + completion}
            if cached:
                u["prompt_tokens_details"] = {"cached_tokens": cached}
            return u

        def send(obj, completion: int | None = None) -> None:
            if completion is not None and opts.get("include_usage") and opts.get("continuous_usage_stats"):
                obj["usage"] = usage(completion)  # vLLM: usage on every chunk when asked
            self._chunk(b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n", split)

        first = {**base, **extra, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]}
        if body.get("return_token_ids"):
            first["prompt_token_ids"] = prompt_ids
        try:
            if reply.get("prefill_delay"):  # like vLLM: headers first, first token after the prefill
                self.wfile.flush()
                self._wait(float(reply["prefill_delay"]))
            send(first, 0)
            pos = 0
            for i, s in enumerate(steps):
                if reply.get("abort_after") is not None and i >= int(reply["abort_after"]):
                    self.wfile.write(b"0\r\n\r\n")
                    self.close_connection = True
                    return
                if reply.get("garbage_after") is not None and i >= int(reply["garbage_after"]):
                    send({**base, "choices": "not a list"})  # a chunk no client can read
                if reply.get("error_after") is not None and i >= int(reply["error_after"]):
                    send({"error": {"message": "scripted failure mid-stream", "type": "InternalServerError",
                                    "code": 500}})
                    self._chunk(b"data: [DONE]\n\n", split)
                    self.wfile.write(b"0\r\n\r\n")
                    return
                ids = encode(s["text"])
                lps = [{"token": f"token_id:{t}", "logprob": logprob(pos + j, t), "bytes": [t - OFFSET],
                        "top_logprobs": []} for j, t in enumerate(ids)]
                pos += len(ids)
                last = i == len(steps) - 1
                choice = {"index": 0, "delta": s.get("delta") or {},
                          "logprobs": {"content": lps} if body.get("logprobs") else None,
                          "finish_reason": finish if last else None}
                if last:
                    choice["stop_reason"] = stop_reason
                if body.get("return_token_ids"):
                    choice["token_ids"] = ids
                send({**base, "choices": [choice]}, pos)
                if delay:
                    self.wfile.flush()
                    self._wait(delay)
            if not steps:
                send({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish,
                                           "stop_reason": stop_reason, "token_ids": []}]}, pos)
            if opts.get("include_usage"):
                send({**base, "choices": [], "usage": usage(pos)})
            self._chunk(b"data: [DONE]\n\n", split)
            self.wfile.write(b"0\r\n\r\n")
        except ConnectionError:  # broken pipe, reset, or the client left during a delay
            self.close_connection = True


class ScriptedServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    def handle_error(self, request, client_address) -> None:
        import sys
        if isinstance(sys.exc_info()[1], (ConnectionError, BrokenPipeError)):
            return  # clients closing idle keep-alive connections
        super().handle_error(request, client_address)

    def __init__(self, addr, state: Scripted) -> None:
        self.state = state
        super().__init__(addr, Handler)


def serve(port: int, host: str = "127.0.0.1", **kwargs) -> ScriptedServer:
    """Start a scripted engine in a background thread (for in-process use); returns the server."""
    srv = ScriptedServer((host, port), Scripted(**kwargs))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def main(argv: list[str] | None = None) -> None:
    from app.config import get_settings

    ap = argparse.ArgumentParser(description="Turnstile scripted engine (deterministic; engine contract)")
    ap.add_argument("--port", type=int, default=8200)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--script", default=get_settings().engine_script,
                    help='JSON file {"default": [reply...], "episodes": {"<episode id>": [reply...]}} '
                         '(default: TURNSTILE_SCRIPT)')
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--policy-version", type=int, default=None)
    args = ap.parse_args(argv)
    script = json.load(open(args.script)) if args.script else None
    srv = ScriptedServer((args.host, args.port), Scripted(script, args.max_model_len, args.model,
                                                           args.policy_version))
    print(f"scripted engine on http://{args.host}:{args.port} model={args.model}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
