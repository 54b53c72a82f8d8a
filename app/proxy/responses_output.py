"""The engine's answer as OpenAI Responses output: the non-stream body and the SSE events.

``render`` builds the ``response`` object of a finished answer; ``Stream`` writes the same answer
as Responses SSE events while it is generated (``app.proxy.apis.StreamWriter``).  Both build their
output items with the same functions, so a streamed answer's final ``response`` equals the
non-stream one: a ``reasoning`` item (its text also signed into ``encrypted_content``, read back
by ``app.proxy.responses`` when it returns as input), a ``message`` item, and a ``function_call``
item per tool call, or ``custom_tool_call`` for a freeform tool and with ``namespace`` for an MCP
tool.  Events carry an increasing ``sequence_number``; items are opened and closed one at a time.

Spec: https://platform.openai.com/docs/api-reference/responses/object and
https://platform.openai.com/docs/api-reference/responses-streaming
"""
from __future__ import annotations

import json
import time

from app.proxy import common as c
from app.proxy.canonical import Result, new_id
from app.proxy.errors import GatewayError, openai_error_object
from app.proxy.sse import FrameTemplate, frame


def _usage(r: Result) -> dict:
    return {"input_tokens": r.prompt_tokens, "input_tokens_details": {"cached_tokens": r.cached_tokens},
            "output_tokens": r.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": r.prompt_tokens + r.completion_tokens}


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [],
            "encrypted_content": c.reasoning_signature(text) if text else None, "status": status}


def _message_item(item_id: str, text: str, refusal: str = "", status: str = "completed") -> dict:
    part = ({"type": "refusal", "refusal": refusal} if refusal and not text
            else {"type": "output_text", "text": text, "annotations": [], "logprobs": []})
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def _call_item(norm: c.Normalized, item_id: str, call_id: str, name: str, arguments: str,
               status: str = "completed") -> dict:
    if name in norm.meta.get("custom_tools", ()):
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            value = {"input": arguments}
        raw = value.get("input") if isinstance(value, dict) else None
        return {"id": item_id.replace("fc_", "ctc_", 1), "type": "custom_tool_call", "call_id": call_id,
                "name": name, "input": raw if isinstance(raw, str) else arguments, "status": status}
    item = {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}
    ns = norm.meta.get("namespaces", {}).get(name)
    if ns:
        item["namespace"] = ns
    return item


def response_object(norm: c.Normalized, resp_id: str, created: int, output: list, r: Result | None,
                    status: str, error: dict | None = None) -> dict:
    req = norm.meta.get("request", {})
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": resp_id, "object": "response", "created_at": created, "status": status, "model": norm.model,
            "output": output, "usage": _usage(r) if r is not None and status != "in_progress" else None,
            "error": error, "incomplete_details": incomplete, "instructions": req.get("instructions"),
            "tools": req.get("tools") or [], "tool_choice": req.get("tool_choice") or "auto",
            "parallel_tool_calls": req.get("parallel_tool_calls", True), "temperature": req.get("temperature"),
            "top_p": req.get("top_p"), "max_output_tokens": req.get("max_output_tokens"),
            "previous_response_id": req.get("previous_response_id"), "reasoning": req.get("reasoning"),
            "store": req.get("store", True), "text": req.get("text") or {"format": {"type": "text"}},
            "truncation": "disabled", "metadata": req.get("metadata") or {}}


def _finish(r: Result) -> str:
    # A length stop inside a tool call is incomplete too; the cut call's item says "incomplete".
    return "incomplete" if r.finish_reason == "length" else "completed"


def render(r: Result, norm: c.Normalized, resp_id: str) -> dict:
    output: list[dict] = []
    if r.reasoning:
        output.append(_reasoning_item(new_id("rs_"), r.reasoning))
    if r.text or (r.refusal and not r.tool_calls):
        output.append(_message_item(new_id("msg_"), r.text, r.refusal))
    for call in r.tool_calls:
        status = "incomplete" if r.cut_short and call is r.tool_calls[-1] else "completed"
        output.append(_call_item(norm, new_id("fc_"), call.id, call.name, call.arguments, status))
    return response_object(norm, resp_id, int(time.time()), output, r, _finish(r))


class Stream:
    """The Responses SSE writer (`app.proxy.apis.StreamWriter`): one answer's events, in order."""

    def __init__(self, norm: c.Normalized, resp_id: str) -> None:
        self.norm, self.resp_id, self.created = norm, resp_id, int(time.time())
        self.seq = 0
        self.output: list[dict] = []   # completed items, in output_index order
        self.open: dict | None = None  # {"kind", "item", "text"|"args", "k"}
        self.done = False
        self.final: dict | None = None
        self._text_frame: FrameTemplate | None = None

    def _ev(self, typ: str, data: dict) -> bytes:
        body = {"type": typ, "sequence_number": self.seq, **data}
        self.seq += 1
        return frame(body, typ)

    def _text_delta(self, item_id: str, text: str) -> bytes:
        """The output_text.delta event, byte for byte as `_ev` writes it (by template)."""
        if self._text_frame is None:
            slot = FrameTemplate.slot
            self._text_frame = FrameTemplate(
                {"type": "response.output_text.delta", "sequence_number": slot(0), "item_id": slot(1),
                 "output_index": slot(2), "content_index": 0, "delta": slot(3), "logprobs": []},
                "response.output_text.delta", 4)
        seq, self.seq = self.seq, self.seq + 1
        return self._text_frame.render(seq, item_id, self._index, text)

    def _resp(self, status: str, r: Result | None = None, error: dict | None = None) -> dict:
        return response_object(self.norm, self.resp_id, self.created, list(self.output), r, status, error)

    def opening(self) -> list[bytes]:
        return [self._ev("response.created", {"response": self._resp("in_progress")}),
                self._ev("response.in_progress", {"response": self._resp("in_progress")})]

    def keepalive(self) -> bytes:
        return self._ev("response.in_progress", {"response": self._resp("in_progress")})

    def start(self, r: Result) -> list[bytes]:
        return []

    @property
    def _index(self) -> int:
        return len(self.output)

    def _close(self, cut: bool = False) -> list[bytes]:
        o = self.open
        if o is None:
            return []
        self.open = None
        idx, item = self._index, o["item"]
        out = []
        if o["kind"] == "reasoning":
            part = {"type": "reasoning_text", "text": o["text"]}
            out.append(self._ev("response.reasoning_text.done", {"item_id": item["id"], "output_index": idx,
                                                                 "content_index": 0, "text": o["text"]}))
            out.append(self._ev("response.content_part.done", {"item_id": item["id"], "output_index": idx,
                                                               "content_index": 0, "part": part}))
            item = _reasoning_item(item["id"], o["text"])
        elif o["kind"] == "message":
            part = {"type": "output_text", "text": o["text"], "annotations": [], "logprobs": []}
            out.append(self._ev("response.output_text.done", {"item_id": item["id"], "output_index": idx,
                                                              "content_index": 0, "text": o["text"], "logprobs": []}))
            out.append(self._ev("response.content_part.done", {"item_id": item["id"], "output_index": idx,
                                                               "content_index": 0, "part": part}))
            item = _message_item(item["id"], o["text"])
        else:
            final = _call_item(self.norm, item["id"], item["call_id"], item["name"], o["args"],
                               "incomplete" if cut else "completed")
            if final["type"] == "custom_tool_call":
                out.append(self._ev("response.custom_tool_call_input.done", {
                    "item_id": final["id"], "output_index": idx, "input": final["input"]}))
            else:
                # Always send `.done` with the full arguments: some consumers read only it.
                out.append(self._ev("response.function_call_arguments.done", {
                    "item_id": item["id"], "output_index": idx, "name": item["name"], "arguments": o["args"]}))
            item = final
        out.append(self._ev("response.output_item.done", {"output_index": idx, "item": item}))
        self.output.append(item)
        return out

    def _open(self, kind: str, item: dict, **state) -> list[bytes]:
        out = self._close()
        self.open = {"kind": kind, "item": item, "text": "", "args": "", **state}
        out.append(self._ev("response.output_item.added", {"output_index": self._index, "item": item}))
        if kind == "reasoning":
            out.append(self._ev("response.content_part.added", {"item_id": item["id"], "output_index": self._index,
                                                                "content_index": 0,
                                                                "part": {"type": "reasoning_text", "text": ""}}))
        elif kind == "message":
            out.append(self._ev("response.content_part.added", {
                "item_id": item["id"], "output_index": self._index, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}))
        return out

    def on_event(self, ev: tuple, r: Result) -> list[bytes]:
        kind, out = ev[0], []
        o = self.open
        if kind == "reasoning":
            if not o or o["kind"] != "reasoning":
                out += self._open("reasoning", {"id": new_id("rs_"), "type": "reasoning", "summary": [],
                                                "content": [], "status": "in_progress"})
            self.open["text"] += ev[1]
            out.append(self._ev("response.reasoning_text.delta", {"item_id": self.open["item"]["id"],
                                                                  "output_index": self._index,
                                                                  "content_index": 0, "delta": ev[1]}))
        elif kind == "text" or (kind == "refusal" and not r.text and not r.tool_calls):
            if not o or o["kind"] != "message":
                out += self._open("message", {"id": new_id("msg_"), "type": "message", "role": "assistant",
                                              "status": "in_progress", "content": []})
            self.open["text"] += ev[1]
            out.append(self._text_delta(self.open["item"]["id"], ev[1]))
        elif kind == "tool_start":
            _, k, call_id, name = ev
            item = _call_item(self.norm, new_id("fc_"), call_id, name, "", status="in_progress")
            out += self._open("call", item, k=k)  # custom tools are announced as custom_tool_call
        elif kind == "tool_args":
            if o and o["kind"] == "call" and o.get("k") == ev[1]:
                o["args"] += ev[2]
                if o["item"]["name"] not in self.norm.meta.get("custom_tools", ()):
                    out.append(self._ev("response.function_call_arguments.delta", {
                        "item_id": o["item"]["id"], "output_index": self._index, "delta": ev[2]}))
            elif "interleaved_tool_args" not in r.flags:
                r.flags.append("interleaved_tool_args")
        return out

    def finish(self, r: Result) -> list[bytes]:
        out = self._close(cut=r.cut_short)
        status = _finish(r)
        self.final = self._resp(status, r)
        out.append(self._ev("response.completed" if status == "completed" else "response.incomplete",
                            {"response": self.final}))
        self.done = True
        return out

    def fail(self, err: GatewayError, r: Result) -> list[bytes]:
        out = self._close()
        self.final = self._resp("failed", r, openai_error_object(err))
        out.append(self._ev("response.failed", {"response": self.final}))
        self.done = True
        return out

    def final_body(self, r: Result) -> dict:
        return self.final or self._resp(_finish(r), r)
