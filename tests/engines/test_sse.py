"""The project's SSE parser (`app.engines.sse`) on the event-stream forms the WHATWG spec allows
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation)."""
from __future__ import annotations

from app.engines.sse import SSEDecoder, iter_json_events


def _feed_all(raw: bytes, cut: int | None = None) -> list:
    dec = SSEDecoder()
    if cut is None:
        return dec.feed(raw) + dec.close()
    return dec.feed(raw[:cut]) + dec.feed(raw[cut:]) + dec.close()


def test_sse_data_without_space_multiline_comments_and_line_ends():
    raw = (b"\xef\xbb\xbf: comment first\r\n"
           b"data:{\"a\":1}\r\n\r\n"            # no space after the colon, CRLF
           b"event: x\rdata:  two\rdata:lines\r\r"  # CR only; only ONE leading space is dropped
           b"event: lonely\n\n"                 # no data: not dispatched, name reset
           b"data\n\n"                          # field without colon: empty value
           b"data: [DONE]\n\n")
    expected = [(None, '{"a":1}'), ("x", " two\nlines"), (None, ""), (None, "[DONE]")]
    assert _feed_all(raw) == expected
    for cut in range(1, len(raw)):  # CRLF, BOM and UTF-8 split across network reads
        assert _feed_all(raw, cut) == expected, cut


def test_sse_cr_then_lf_in_separate_reads_is_one_line_end():
    dec = SSEDecoder()
    assert dec.feed(b"data: 1\r") == []
    assert dec.feed(b"\ndata: 2\r\n\r\n") == [(None, "1\n2")]


def test_iter_json_events_stops_at_done_and_skips_empty_data():
    chunks = [b'data:{"n":1}\n', b"\ndata:\n\n", b'data: {"n":2}\n\ndata:[DONE]\n\n', b'data: {"n":3}\n\n']
    assert list(iter_json_events(chunks)) == [{"n": 1}, {"n": 2}]
