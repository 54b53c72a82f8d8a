"""Server-sent events: writing frames and reading an upstream byte stream.

Frame format (https://html.spec.whatwg.org/multipage/server-sent-events.html):
`event: NAME\\n` (optional) + `data: JSON\\n` + a blank line; lines starting with
`:` are comments (keep-alives).  Upstream bytes are decoded with an incremental
UTF-8 decoder and split only on blank lines of the decoded text, because TCP
chunks split multi-byte characters (protocols.md §0 rule 1; claude-code-router
PR #1672).
"""
from __future__ import annotations

import codecs
import json
from typing import Iterator

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def dumps(obj) -> str:
    """Compact JSON text (UTF-8 kept as is)."""
    return _dumps(obj)


def frame(data: dict | str, event: str | None = None) -> bytes:
    """One SSE frame as UTF-8 bytes; `data` is a dict (JSON-encoded) or a raw string."""
    payload = data if isinstance(data, str) else _dumps(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode("utf-8")


COMMENT_KEEPALIVE = b": keep-alive\n\n"


class SSEDecoder:
    """Incremental SSE parser: `feed(bytes)` -> list of (event_name | None, data_text)."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""

    def feed(self, data: bytes) -> list[tuple[str | None, str]]:
        self._buf += self._utf8.decode(data)
        if "\r" in self._buf:
            self._buf = self._buf.replace("\r\n", "\n").replace("\r", "\n")
        out = []
        while True:
            cut = self._buf.find("\n\n")
            if cut < 0:
                break
            block, self._buf = self._buf[:cut], self._buf[cut + 2:]
            event, lines = None, []
            for line in block.split("\n"):
                if not line or line.startswith(":"):
                    continue
                name, _, value = line.partition(":")
                if value.startswith(" "):
                    value = value[1:]
                if name == "event":
                    event = value
                elif name == "data":
                    lines.append(value)
            if lines or event:
                out.append((event, "\n".join(lines)))
        return out

    def close(self) -> list[tuple[str | None, str]]:
        """Flush a final frame that lacks its blank line."""
        tail = self._utf8.decode(b"", final=True)
        self._buf += tail
        if self._buf.strip():
            self._buf += "\n\n"
            return self.feed(b"")
        return []


def iter_json_events(chunks: Iterator[bytes]) -> Iterator[dict]:
    """Upstream Chat Completions SSE bytes -> parsed JSON chunks, stopping at `[DONE]`."""
    dec = SSEDecoder()
    for raw in chunks:
        for _event, data in dec.feed(raw):
            if data.strip() == "[DONE]":
                return
            if data:
                yield json.loads(data)
    for _event, data in dec.close():
        if data.strip() == "[DONE]":
            return
        if data:
            yield json.loads(data)
