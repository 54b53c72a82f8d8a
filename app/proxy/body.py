"""A gateway request's body, from the bytes on the wire to a JSON object the gateway may record.

`read_body` applies, in order: the size cap (Flask's MAX_CONTENT_LENGTH, then again after
decompression), the Content-Encoding (gzip, deflate, zstd; at most `MAX_CODINGS` of them, a zstd
window of at most `ZSTD_MAX_WINDOW`), strict JSON (no `NaN`, an object
at the top) and `app.text.storable` (U+0000 and lone surrogates become U+FFFD: the engine must
see exactly what is recorded).  Every refusal is a `GatewayError`, answered in the caller's
API shape by the router.
"""
from __future__ import annotations

import json
import zlib

from werkzeug.exceptions import RequestEntityTooLarge

from app.proxy.errors import GatewayError
from app.text import may_hold_unstorable, storable


def read_body(request, limit: int) -> tuple[bytes, dict]:
    """(decoded bytes, parsed object) of a Flask `request`'s body of at most `limit` bytes,
    before and after decompression.

    Raises:
        GatewayError: too_large (413), unsupported_media (415, an unknown Content-Encoding) or
            invalid_request (400: bad compressed data, empty body, not JSON, not an object).
    """
    try:
        raw = request.get_data(cache=False)
    except RequestEntityTooLarge:
        raise GatewayError("too_large", f"Request body exceeds {limit} bytes") from None
    if request.headers.get("content-encoding"):
        raw = decode_body(raw, request.headers["content-encoding"], limit)
    return raw, parse_body(raw)


def decode_body(raw: bytes, encoding: str, limit: int) -> bytes:
    """The request body with its Content-Encoding removed (RFC 9110 §8.4: codings listed in
    the order applied).  gzip, deflate and zstd (RFC 8878; Codex compresses with it) are
    accepted; an unknown coding is a 415 (RFC 9110 §15.5.16); the decoded body may not
    exceed `limit` bytes, so a small compression bomb cannot exhaust memory.  At most
    `MAX_CODINGS` codings: each is undone up to `limit`, so a header listing hundreds of them would
    make one small body cost hundreds of decompressions."""
    codings = [c.strip().lower() for c in encoding.split(",") if c.strip()]
    if len(codings) > MAX_CODINGS:
        raise GatewayError("unsupported_media", f"At most {MAX_CODINGS} Content-Encoding codings are accepted, "
                                                f"got {len(codings)}")
    for coding in reversed(codings):
        if coding == "identity":
            continue
        if coding in ("gzip", "x-gzip", "deflate"):
            # wbits 47 reads gzip and zlib headers; raw deflate (no header) is accepted too.
            wbits = 47 if coding != "deflate" or raw[:1] == b"\x78" else -15
            d = zlib.decompressobj(wbits)
            try:
                out = d.decompress(raw, limit + 1)
            except zlib.error as exc:
                raise GatewayError("invalid_request", f"Request body is not valid {coding} data: {exc}") from None
            if not d.eof and len(out) <= limit:
                raise GatewayError("invalid_request", f"Request body is truncated {coding} data")
        elif coding == "zstd":
            out = _unzstd(raw, limit)
        else:
            raise GatewayError("unsupported_media", f"Unsupported Content-Encoding {coding!r}; "
                                                    f"use gzip, deflate, zstd or identity")
        if len(out) > limit:
            raise GatewayError("too_large", f"Request body exceeds {limit} bytes once decompressed")
        raw = out
    return raw


MAX_CODINGS = 3
# A zstd frame names its window size, which the decoder allocates up front (up to 128 MiB by default
# in libzstd, whatever the frame's content): capped at the 8 MiB that RFC 8878 section 3.1.1.1.2
# asks every decoder to support; Codex's encoder (zstd level 3) uses at most 2 MiB.
ZSTD_MAX_WINDOW = 8 * 1024 * 1024


def _unzstd(raw: bytes, limit: int) -> bytes:
    """At most `limit` + 1 bytes of zstd-compressed `raw` (one more than allowed tells too large),
    every frame of it (RFC 8878 section 3: a body may hold several)."""
    import zstandard  # only Codex sends zstd: imported on first use

    try:
        with zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).stream_reader(
                raw, read_across_frames=True) as reader:
            out = reader.read(limit + 1)
            while len(out) <= limit:
                more = reader.read(limit + 1 - len(out))
                if not more:
                    break
                out += more
    except zstandard.ZstdError as exc:
        if "too much memory" in str(exc):  # libzstd's words for a window past max_window_size
            raise GatewayError("too_large", f"Request body's zstd frame needs a window over {ZSTD_MAX_WINDOW} "
                                            f"bytes") from None
        raise GatewayError("invalid_request", f"Request body is not valid zstd data: {exc}") from None
    return out


def parse_body(raw: bytes) -> dict:
    """`raw` parsed as one JSON object (RFC 8259), its unstorable text replaced (`app.text.storable`).

    Raises:
        GatewayError: invalid_request when `raw` is empty, not JSON (`NaN` included), nested
            deeper than the parser allows, or not an object.
    """
    if not raw.strip():
        raise GatewayError("invalid_request", "Request body is empty; expected a JSON object")
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise GatewayError("invalid_request", "Request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise GatewayError("invalid_request", f"Request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise GatewayError("invalid_request", f"Request body must be a JSON object, got {type(body).__name__}")
    if may_hold_unstorable(raw):
        body = storable(body)
    return body


def _no_constant(name: str):
    """`NaN`, `Infinity`, `-Infinity` are not JSON (RFC 8259 §6), though Python's parser accepts them;
    they must not reach the engine nor the record (SQLite's and PostgreSQL's JSON reject them)."""
    raise ValueError(f"{name} is not a JSON number (RFC 8259 section 6)")
