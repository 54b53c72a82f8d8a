"""A gateway request body: Content-Encoding, size cap, strict JSON, text the database cannot store
(`app.proxy.body`), read through a real Flask request."""
from __future__ import annotations

import gzip
import json
import zlib

import pytest
import zstandard
from flask import Flask, request

from app.proxy.body import decode_body, parse_body, read_body
from app.proxy.errors import GatewayError

DOC = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi " * 50}]}).encode()


def _deflate_raw(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-15)
    return c.compress(data) + c.flush()


# mtime=0: gzip stamps the time into its header, and the test ids (the bytes) must be the same in
# every xdist process that collects them.
@pytest.mark.parametrize("coding,packed", [
    ("gzip", gzip.compress(DOC, mtime=0)), ("x-gzip", gzip.compress(DOC, mtime=0)), ("deflate", zlib.compress(DOC)),
    ("deflate", _deflate_raw(DOC)), ("zstd", zstandard.ZstdCompressor().compress(DOC)), ("identity", DOC),
    # codings are listed in the order applied (RFC 9110 section 8.4): undone last to first
    ("gzip, zstd", zstandard.ZstdCompressor().compress(gzip.compress(DOC, mtime=0))),
])
def test_each_coding_is_undone(coding, packed):
    assert decode_body(packed, coding, 10_000) == DOC


@pytest.mark.parametrize("coding,packed,kind", [
    ("br", DOC, "unsupported_media"),
    ("gzip", gzip.compress(DOC, mtime=0)[:-12], "invalid_request"),  # truncated
    ("gzip", b"not gzip at all", "invalid_request"),
    ("zstd", b"not zstd", "invalid_request"),
    ("gzip", gzip.compress(b" " * 200_000, mtime=0), "too_large"),  # a small bomb stops at the cap
    ("zstd", zstandard.ZstdCompressor().compress(b" " * 200_000), "too_large"),
])
def test_bad_or_oversized_codings_are_the_callers_error(coding, packed, kind):
    with pytest.raises(GatewayError) as exc:
        decode_body(packed, coding, 10_000)
    assert exc.value.kind == kind


@pytest.mark.parametrize("raw,words", [
    (b"", "empty"), (b"  \n", "empty"), (b"[1, 2]", "must be a JSON object"), (b"{", "not valid JSON"),
    (b'{"temperature": NaN}', "NaN is not a JSON number"), (b'{"x": -Infinity}', "not a JSON number"),
    (b"\xff\xfe{}", "not valid JSON"), (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
])
def test_what_is_not_one_json_object_is_refused(raw, words):
    with pytest.raises(GatewayError, match=words) as exc:
        parse_body(raw)
    assert exc.value.status == 400


def test_text_the_database_cannot_store_becomes_the_replacement_character():
    raw = b'{"a\\u0000": ["x\\u0000y", {"s": "\\ud83d"}], "pair": "\\ud83d\\ude00", "low": "\\uDC00"}'
    assert parse_body(raw) == {"a\ufffd": ["x\ufffdy", {"s": "\ufffd"}], "pair": "\U0001F600", "low": "\ufffd"}
    plain = b'{"a": "\\u00e9"}'
    assert parse_body(plain) == {"a": "\u00e9"}


def test_read_body_caps_the_wire_size_and_decodes_before_parsing():
    app = Flask("t")
    app.config["MAX_CONTENT_LENGTH"] = 1000
    with app.test_request_context("/v1/chat/completions", method="POST", data=gzip.compress(DOC, mtime=0),
                                  headers={"Content-Encoding": "gzip"}):
        raw, body = read_body(request, 1000)
        assert raw == DOC and body["model"] == "m"
    with app.test_request_context("/v1/chat/completions", method="POST", data=b" " * 2000):
        with pytest.raises(GatewayError) as exc:
            read_body(request, 1000)
        assert exc.value.kind == "too_large" and exc.value.status == 413


def test_a_coding_list_longer_than_the_cap_is_refused_before_decoding():
    packed = DOC
    for _ in range(4):
        packed = gzip.compress(packed, mtime=0)
    with pytest.raises(GatewayError, match="At most 3") as exc:
        decode_body(packed, "gzip, gzip, gzip, gzip", 10_000)
    assert exc.value.status == 415
    assert decode_body(gzip.compress(gzip.compress(DOC, mtime=0), mtime=0), "gzip, gzip", 10_000) == DOC


def test_a_zstd_frame_asking_for_a_huge_window_is_a_413_not_an_allocation():
    """A 50-byte frame whose header names a 128 MiB window (no content size): libzstd would
    allocate the window before the first output byte."""
    import io
    params = zstandard.ZstdCompressionParameters(window_log=27, write_content_size=False)
    buf = io.BytesIO()
    with zstandard.ZstdCompressor(compression_params=params).stream_writer(buf, closefd=False) as w:
        w.write(b" " * (1 << 20))
    assert zstandard.get_frame_parameters(buf.getvalue()).window_size == 1 << 27
    with pytest.raises(GatewayError) as exc:
        decode_body(buf.getvalue(), "zstd", 1 << 24)
    assert exc.value.kind == "too_large" and exc.value.status == 413


def test_every_zstd_frame_of_a_body_is_decoded():
    half = len(DOC) // 2
    packed = zstandard.ZstdCompressor().compress(DOC[:half]) + zstandard.ZstdCompressor().compress(DOC[half:])
    assert decode_body(packed, "zstd", 10_000) == DOC
