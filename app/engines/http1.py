"""HTTP/1.1 framing of an engine call, as bytes: the request out, the answer's head and body in.

Nothing here touches a socket.  ``request_bytes`` builds a ``POST`` with a JSON body;
``parse_head`` reads the status line and header fields of an answer and says how its body is
framed; ``BodyReader`` undoes that framing (``Transfer-Encoding: chunked``, ``Content-Length`` or
the connection's close) one network read at a time.  The rules are RFC 9112's:
https://www.rfc-editor.org/rfc/rfc9112 (section 4: status line, 5: field lines, 6: message body,
7.1: chunked transfer coding).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

MAX_HEAD = 64 * 1024       # bytes of status line + header fields accepted

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")


def request_bytes(path: str, authority: str, body: dict, headers: dict | None, accept: str) -> bytes:
    """``POST path`` to ``authority`` with ``body`` as compact UTF-8 JSON and the caller's ``headers``
    added, as the bytes to send.

    Raises:
        ValueError: a header name is empty or holds ``:``, or a name or value holds CR, LF or NUL
            (they would split the request).
    """
    data = _dumps(body).encode("utf-8")
    lines = [f"POST {path} HTTP/1.1", f"Host: {authority}", "Content-Type: application/json",
             f"Accept: {accept}", "Accept-Encoding: identity", f"Content-Length: {len(data)}"]
    for k, v in (headers or {}).items():
        k, v = str(k), str(v)
        if any(c in k + v for c in "\r\n\0") or not k or ":" in k:
            raise ValueError(f"invalid header for the engine request: {k!r}")
        lines.append(f"{k}: {v}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data


@dataclass
class Head:
    """An answer's head: its status code, whether the connection may serve another request after
    the body (HTTP/1.1 without ``Connection: close``, and a body that ends by its framing), and the
    reader for its body."""

    status: int
    keep: bool
    body: "BodyReader"


def parse_head(head: bytes) -> Head:
    """The bytes before the blank line that ends a head (without it) -> ``Head``.  Repeated
    fields are joined with ", " (RFC 9112 5.3); a body with neither ``Transfer-Encoding`` nor
    ``Content-Length`` runs to the connection's close.

    Raises:
        ValueError: a bad status line or field line, a transfer coding that does not end in
            ``chunked``, or a ``Content-Length`` that is not a decimal number.
    """
    lines = head.decode("latin-1").split("\r\n")
    proto, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not proto.startswith("HTTP/1.") or not code.isdigit():
        raise ValueError(f"bad status line {lines[0][:60]!r}")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ValueError(f"bad header line {line[:60]!r}")
        key = name.lower()
        fields[key] = f"{fields[key]}, {value.strip()}" if key in fields else value.strip()
    keep = proto == "HTTP/1.1" and "close" not in fields.get("connection", "").lower()
    te = fields.get("transfer-encoding", "").lower()
    if te:
        if te.replace(" ", "").split(",")[-1] != "chunked":
            raise ValueError(f"unsupported transfer-encoding {te!r}")
        body = BodyReader("chunked")
    elif "content-length" in fields:
        length = fields["content-length"]
        if not length.isdigit():
            raise ValueError(f"bad content-length {length!r}")
        body = BodyReader("length", int(length))
    else:
        body, keep = BodyReader("close"), False
    return Head(int(code), keep, body)


class BodyReader:
    """Undoes the body's framing in one pass per network read: ``feed(bytes)`` -> payload bytes.

    mode: "chunked" | "length" | "close".  ``complete`` becomes True at the end of a chunked or
    sized body; ``clean`` is False when bytes came after it (the connection is then not reused).
    Malformed chunk framing sets ``broken`` (what was wrong); the payload before it is still
    returned, and every later ``feed`` raises.

    Raises (from ``feed``):
        ValueError: the framing was found malformed in an earlier read.
    """

    def __init__(self, mode: str, length: int = 0) -> None:
        self.mode, self.left = mode, length
        self.complete = mode == "length" and length == 0
        self.clean = True
        self._raw = b""
        self._state = "size"   # chunked: size | data | crlf | trailer
        self.broken: str | None = None

    def feed(self, data: bytes) -> bytes:
        if self.broken is not None:
            raise ValueError(self.broken)
        if self.complete:
            if data:
                self.clean = False
            return b""
        if self.mode == "close":
            return data
        if self.mode == "length":
            take = data[:self.left]
            self.left -= len(take)
            self.complete = self.left == 0
            if len(data) > len(take):
                self.clean = False
            return take
        out: list[bytes] = []
        try:
            self._chunked(self._raw + data if self._raw else data, out)
        except ValueError as exc:
            self.broken = str(exc)
        return out[0] if len(out) == 1 else b"".join(out)

    def _chunked(self, buf: bytes, out: list[bytes]) -> None:
        i, n = 0, len(buf)
        while i < n:
            state = self._state
            if state == "data":
                take = min(self.left, n - i)
                out.append(buf[i:i + take])
                i += take
                self.left -= take
                if not self.left:
                    self._state = "crlf"
                continue
            if state == "crlf":
                if n - i < 2:
                    break
                if buf[i:i + 2] != b"\r\n":
                    raise ValueError("chunk data not followed by CRLF")
                i += 2
                self._state = "size"
                continue
            j = buf.find(b"\r\n", i)
            if j < 0:
                if n - i > 4096:
                    raise ValueError("chunk line too long")
                break
            line = buf[i:j]
            i = j + 2
            if state == "trailer":
                if not line:
                    self.complete = True
                    if i < n:
                        self.clean = False
                    i = n
                continue
            size = line.split(b";", 1)[0].strip()
            if not _HEX.fullmatch(size):
                raise ValueError(f"bad chunk size line {line[:40]!r}")
            self.left = int(size, 16)
            self._state = "data" if self.left else "trailer"
        self._raw = buf[i:]
