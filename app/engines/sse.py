"""Reading server-sent events: the one SSE parser of the project (engine client and gateway).

Follows the WHATWG event-stream interpretation
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation):
lines end with CRLF, LF or CR (a CR at the end of one network read and an LF at the start of
the next are one line end); a leading BOM is dropped; lines starting with ``:`` are comments
(keep-alives); ``field:value`` drops exactly one space after the colon, so ``data:{...}`` and
``data: {...}`` carry the same value; a line without a colon is a field with an empty value;
several ``data`` lines of one event are joined with ``\\n``; a blank line dispatches the event,
and an event without ``data`` lines is not dispatched (its ``event`` name is reset).  ``id`` and
``retry`` are not used by the engine protocol and are ignored.

Bytes are decoded with an incremental UTF-8 decoder (invalid bytes become U+FFFD), because a
network read may end inside a multi-byte character.

One deliberate leniency: ``close()`` dispatches a last event whose blank line never came (the
spec discards it), so an engine that ends its stream with ``data: [DONE]`` and no blank line
still ends cleanly.
"""
from __future__ import annotations

import codecs
import json
from typing import Iterable, Iterator

Event = tuple[str | None, str]   # (event name or None, data text)


class SSEDecoder:
    """Incremental parser: ``feed(bytes)`` -> complete events as ``(event_name | None, data)``."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""            # text after the last line end
        self._skip_lf = False     # the previous read ended with CR: a leading LF belongs to it
        self._started = False     # BOM check done
        self._event: str | None = None
        self._data: list[str] = []

    def feed(self, data: bytes) -> list[Event]:
        """Parse ``data`` (any slice of the byte stream); returns the events it completed."""
        return self._text(self._utf8.decode(data))

    def close(self) -> list[Event]:
        """End of stream: flush the decoder and dispatch a final event lacking its blank line."""
        out = self._text(self._utf8.decode(b"", final=True))
        if self._buf:
            self._line(self._buf, out)
            self._buf = ""
        self._line("", out)
        return out

    def _text(self, text: str) -> list[Event]:
        out: list[Event] = []
        if not text:
            return out
        if not self._started:
            self._started = True
            if text.startswith("\ufeff"):
                text = text[1:]
        if self._skip_lf:
            self._skip_lf = False
            if text.startswith("\n"):
                text = text[1:]
        buf = self._buf + text
        if "\r" in buf:
            buf = buf.replace("\r\n", "\n")
            if buf.endswith("\r"):
                self._skip_lf = True
            buf = buf.replace("\r", "\n")
        lines = buf.split("\n")
        self._buf = lines.pop()
        for line in lines:  # the two common lines inline (`_line` has the same rules), the rest there
            if not line:
                if self._data:
                    out.append((self._event, "\n".join(self._data) if len(self._data) > 1 else self._data[0]))
                self._event, self._data = None, []
            elif line.startswith("data:"):
                self._data.append(line[6:] if line[5:6] == " " else line[5:])
            else:
                self._line(line, out)
        return out

    def _line(self, line: str, out: list[Event]) -> None:
        if not line:
            if self._data:
                out.append((self._event, "\n".join(self._data)))
            self._event, self._data = None, []
            return
        if line[0] == ":":
            return
        name, _, value = line.partition(":")
        if value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value


def iter_json_events(chunks: Iterable[bytes]) -> Iterator[dict]:
    """Chat Completions SSE bytes -> parsed JSON chunk objects, stopping at ``data: [DONE]``
    (events with empty data are skipped).

    Raises:
        ValueError: an event's data is not JSON.
    """
    dec = SSEDecoder()
    for raw in chunks:
        for _event, data in dec.feed(raw):
            if data.strip() == "[DONE]":
                return
            if data.strip():
                yield json.loads(data)
    for _event, data in dec.close():
        if data.strip() == "[DONE]":
            return
        if data.strip():
            yield json.loads(data)
