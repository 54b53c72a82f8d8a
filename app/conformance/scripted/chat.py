"""The scripted engine's chat completions route (`POST /v1/chat/completions`): checks the prompt
against the context window, plans the reply, and answers it as one JSON object or as an SSE
stream, with the reply's delays (watching the connection) and faults.

`ChatRoute` is a mixin of the server's request handler (`app.conformance.scripted.server.Handler`),
which provides `_json` and `server.state` (a `Scripted`).
"""
from __future__ import annotations

import hashlib
import json
import select
import socket
import time

from app.conformance.scripted.replies import OFFSET, apply_quirk, encode, logprob, plan, render_prompt


class ChatRoute:
    """`complete(body)` answers one chat completions request (see the package docstring)."""

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
