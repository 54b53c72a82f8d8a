"""Text deltas rendered by template (`app.proxy.sse.FrameTemplate`) are the very bytes the general
frame writer gives, for every API and for text JSON must escape."""
from __future__ import annotations

import pytest

from app.proxy import anthropic, chat, gemini, responses
from app.proxy.canonical import ChunkNormalizer
from app.proxy.sse import FrameTemplate, frame

TEXTS = ["x", "", 'quote " and \\ backslash', "héllo wörld ✓ 😀", "\n\t\r\x00\x1f\x7f", "\u2028\u2029", "</script>"]


def test_template_renders_what_frame_writes():
    slot = FrameTemplate.slot
    t = FrameTemplate({"type": "d", "n": slot(0), "nested": {"text": slot(1), "k": [1, None]}}, "d", 2)
    for i, text in enumerate(TEXTS):
        assert t.render(i, text) == frame({"type": "d", "n": i, "nested": {"text": text, "k": [1, None]}}, "d")
    with pytest.raises(ValueError):
        FrameTemplate({"a": slot(0), "b": slot(0)}, None, 1)


def _norm(module, body):
    return module.normalize(body)


@pytest.mark.parametrize("text", TEXTS)
def test_each_apis_text_delta_is_byte_identical(text):
    r = ChunkNormalizer().result
    w = chat.Stream(_norm(chat, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                                 "stream_options": {"include_usage": True}}), "chatcmpl-1")
    assert w._text(text, r) == w._chunk({"content": text}, r)

    w = anthropic.Stream(_norm(anthropic, {"model": "m", "max_tokens": 5, "stream": True,
                                           "messages": [{"role": "user", "content": "hi"}]}), "msg_1")
    for index in (0, 3):
        w.index = index
        assert w._text_delta(text) == w._ev("content_block_delta", {
            "index": index, "delta": {"type": "text_delta", "text": text}})

    w = responses.Stream(_norm(responses, {"model": "m", "input": "hi", "stream": True}), "resp_1")
    w.output = [{"id": "a"}]
    w.seq = 7
    got = w._text_delta("msg_9", text)
    w.seq = 7
    want = w._ev("response.output_text.delta", {"item_id": "msg_9", "output_index": w._index, "content_index": 0,
                                                "delta": text, "logprobs": []})
    assert got == want and w.seq == 8

    w = gemini.Stream(_norm(gemini, {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}), "resp_1")
    w.sent_visible = True
    if text:
        assert w.on_event(("text", text), r) == [w._chunk([{"text": text}])]
