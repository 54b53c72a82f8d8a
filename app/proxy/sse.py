"""Server-sent events the gateway writes to its clients.

Frame format (https://html.spec.whatwg.org/multipage/server-sent-events.html):
`event: NAME\\n` (optional) + `data: JSON\\n` + a blank line; lines starting with
`:` are comments (keep-alives).  Reading an SSE byte stream (the engine's) is
`app.engines.sse.SSEDecoder`, the project's one parser.
"""
from __future__ import annotations

import json

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
