"""Parse Hermes-style ``<tool_call>{json}</tool_call>`` model output into OpenAI tool calls.

One incremental parser serves both paths: streaming feeds text deltas as they are
decoded; non-streaming feeds the whole text once.  Events:

* ``ContentEvent(text)``: assistant text outside tool-call tags.
* ``ToolCallEvent(index, id, name, arguments)``: one complete call; ``arguments`` is a
  JSON string (OpenAI's wire type).  In a stream it becomes a single delta carrying
  ``index``, ``id``, ``type: "function"``, ``function.name`` and the whole
  ``function.arguments`` — the first-fragment shape clients built on the Vercel AI SDK
  validate (https://platform.openai.com/docs/api-reference/chat-streaming).

Rules (aligned with vLLM's ``hermes`` parser, vllm/tool_parsers/hermes_tool_parser.py):
text that could be the start of ``<tool_call>`` is held back until it is decided; a
block whose JSON does not parse, or one still open when generation ends, is returned as
plain content (nothing the model produced is dropped except whitespace that separates
tool calls).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ContentEvent:
    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    index: int
    id: str
    name: str
    arguments: str  # JSON text

    def as_openai(self) -> dict:
        """``{"id", "type": "function", "function": {"name", "arguments"}}`` (message shape)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def as_delta(self) -> dict:
        """The streaming ``delta.tool_calls[]`` element (adds ``index``)."""
        return {"index": self.index, **self.as_openai()}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _decode_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments_json)`` from a tool-call body, or None when it is not a valid call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)


class ToolCallParser:
    """Incremental parser; call ``feed(delta)`` for each text delta, then ``finish()`` once.

    Both return a list of ``ContentEvent``/``ToolCallEvent`` in output order.  Trailing
    whitespace is held back until non-space text follows, so the whitespace between the
    last content and a ``<tool_call>`` (and between calls) is dropped consistently in
    stream and non-stream answers; without any tool call it is emitted at ``finish()``.
    """

    def __init__(self) -> None:
        self._buffer = ""       # undecided text (outside: possible tag start / whitespace; inside: call body)
        self._inside = False
        self._gap = ""          # whitespace dropped before the open tag (restored if the call is invalid)
        self.calls: list[ToolCallEvent] = []

    def feed(self, delta: str) -> list:
        self._buffer += delta
        events: list = []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    return events
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE):]
                self._inside = False
                decoded = _decode_call(body.strip())
                if decoded is None:
                    events.append(ContentEvent(self._gap + OPEN + body + CLOSE))
                else:
                    call = ToolCallEvent(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", *decoded)
                    self.calls.append(call)
                    events.append(call)
                self._buffer = self._buffer.lstrip() if self.calls else self._buffer
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                before = self._buffer[:start]
                if before.strip():
                    events.append(ContentEvent(before.rstrip()))
                self._gap = before[len(before.rstrip()):]
                self._buffer = self._buffer[start + len(OPEN):]
                self._inside = True
                continue
            # No complete opening tag: emit what cannot start one and is not trailing whitespace.
            hold = _partial_suffix(self._buffer, OPEN)
            emit = self._buffer[:len(self._buffer) - hold]
            stripped = emit.rstrip()
            if stripped:
                events.append(ContentEvent(stripped))
            self._buffer = emit[len(stripped):] + self._buffer[len(self._buffer) - hold:]
            return events

    def finish(self) -> list:
        """Flush held text: an unterminated call becomes content; trailing whitespace is kept
        only when no tool call was produced."""
        events: list = []
        if self._inside:
            events.append(ContentEvent(self._gap + OPEN + self._buffer))
        elif self._buffer and (self._buffer.strip() or not self.calls):
            events.append(ContentEvent(self._buffer))
        self._buffer = ""
        self._inside = False
        return events


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCallEvent]]:
    """Non-streaming parse: ``(content or None, tool_calls)`` of a complete model output."""
    parser = ToolCallParser()
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentEvent))
    return (content or None), parser.calls
