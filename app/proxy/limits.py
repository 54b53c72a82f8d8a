"""Size caps on what the gateway decodes and builds from one request.

The body is capped on the wire and once its Content-Encoding is undone (`app.proxy.body`,
TURNSTILE_GATEWAY_MAX_BODY_BYTES).  Inside a body some values expand, so a small body can still
make a large prompt:

* a reasoning signature the gateway issued carries its reasoning zlib-compressed (Anthropic
  `signature`, Responses `encrypted_content`, Gemini `thoughtSignature`); deflate's ratio tops out near 1032:1 (a
  258-byte match, RFC 1951 section 3.2.5, coded in as few as 2 bits), so a forged 84 KiB
  signature inflated to 64 MiB;
* a Responses `previous_response_id` stands for every input and output of its chain, read
  from the record.

So each value decoded from a request inflates to at most TURNSTILE_GATEWAY_MAX_DECODED_BYTES, all of
one request's decoded values together to at most the prompt cap, and the engine request built from
it (messages, tools and options as compact JSON, UTF-8) is at most TURNSTILE_GATEWAY_MAX_PROMPT_BYTES
(the body cap when unset).  Past a cap the caller gets a 413 (`GatewayError` too_large) in its own
API's error shape, raised while the request is normalized: before the engine is asked and before
anything is recorded, so nothing recorded earlier changes.

The running total of one request lives in a `ContextVar` opened by `decoding()` around its
normalization (each gthread thread and each gevent greenlet has its own context); outside one (the
splice and the dashboard reading recorded answers) only the per-value cap applies.
"""
from __future__ import annotations

import json
import zlib
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

from app.proxy.errors import GatewayError
from app.proxy.settings import gateway_settings

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # as the engine client sends
_ascii_dumps = json.JSONEncoder(separators=(",", ":")).encode


@dataclass(frozen=True)
class Caps:
    """decoded: bytes one decoded value may inflate to; prompt: bytes of the engine request and of
    all decoded values of one request together."""

    decoded: int
    prompt: int


def caps() -> Caps:
    """The caps from the gateway's settings (`TURNSTILE_GATEWAY_MAX_DECODED_BYTES`,
    `TURNSTILE_GATEWAY_MAX_PROMPT_BYTES`, which defaults to `TURNSTILE_GATEWAY_MAX_BODY_BYTES`)."""
    s = gateway_settings()
    return Caps(decoded=s.max_decoded_bytes, prompt=s.max_prompt_bytes or s.max_body_bytes)


@dataclass
class _Budget:
    left: int  # bytes the request's decoded values may still add


_budget: ContextVar[_Budget | None] = ContextVar("turnstile_gateway_decode_budget", default=None)


@contextmanager
def decoding(total: int) -> Iterator[None]:
    """The scope of one request's normalization: its decoded values add up to at most `total` bytes."""
    token = _budget.set(_Budget(total))
    try:
        yield
    finally:
        _budget.reset(token)


def inflate(data: bytes, where: str) -> bytes:
    """One zlib stream (RFC 1950) decompressed to at most the room left: the per-value cap, and
    what the request's running total still allows (`decoding`).  Decompression stops one byte past
    the room (`max_length`), so a bomb costs no more memory than the cap.

    Raises:
        GatewayError: too_large (413) when the stream inflates past the room; `where` names the
            value (e.g. `messages.1.content.0.signature`).
        ValueError: the data is not one whole zlib stream (damaged, truncated or followed by more).
    """
    per_value = caps().decoded
    budget = _budget.get()
    room = per_value if budget is None else min(per_value, budget.left)
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, room + 1)
    except zlib.error as exc:
        raise ValueError(f"not zlib data: {exc}") from None
    if len(out) > room or d.unconsumed_tail:
        which = ("TURNSTILE_GATEWAY_MAX_DECODED_BYTES" if room == per_value
                 else "TURNSTILE_GATEWAY_MAX_PROMPT_BYTES, for all decoded values of one request")
        raise GatewayError("too_large", f"{where}: decodes to more than {room} bytes ({which})", param=where)
    if not d.eof or d.unused_data:
        raise ValueError("not one whole zlib stream")
    if budget is not None:
        budget.left -= len(out)
    return out


def check_prompt(chat: dict, limit: int) -> int:
    """A bound on the size in bytes of the engine request `chat` (compact JSON, UTF-8, as the engine
    client sends it), exact when near `limit`; raises GatewayError too_large (413) past `limit`.

    The ASCII-escaped form is measured first: it is never shorter than the UTF-8 form (a
    character outside ASCII is 2-4 bytes of UTF-8 and 6 or 12 escaped), and about 4 times cheaper
    to get than encoding the text to UTF-8 (measured on a 1.5 MB request)."""
    size = len(_ascii_dumps(chat))
    if size <= limit:
        return size
    size = len(_dumps(chat).encode("utf-8"))
    if size > limit:
        raise GatewayError("too_large", f"The request expands to a {size}-byte engine request; at most {limit} "
                                        f"bytes are allowed (TURNSTILE_GATEWAY_MAX_PROMPT_BYTES)")
    return size


def json_size(value) -> int:
    """Bytes of `value` as compact JSON (UTF-8): what it adds to the engine request."""
    return len(_dumps(value).encode("utf-8"))
