"""Pure translation pieces: incremental SSE/UTF-8 decoding, tool-call canonicalization, error
wording; plus the end-to-end UTF-8 split case through the real gateway."""
from __future__ import annotations

import json

import pytest
from support.gateway_calls import APIS, ask

from app.conformance.scripted import directive
from app.engines.sse import SSEDecoder
from app.proxy.canonical import ChunkNormalizer, result_from_completion
from app.proxy.errors import GatewayError, error_body, parse_context_overflow
from app.proxy.sse import frame

TEXT = "ü✓你好 😀"


def test_sse_decoder_survives_every_split_point():
    raw = frame({"delta": TEXT}, "x") + b": comment\n\n" + frame({"n": 2}) + b"data: [DONE]\n\n"
    expected = [("x", json.dumps({"delta": TEXT}, ensure_ascii=False, separators=(",", ":"))),
                (None, '{"n":2}'), (None, "[DONE]")]
    for cut in range(1, len(raw)):
        dec = SSEDecoder()
        got = dec.feed(raw[:cut]) + dec.feed(raw[cut:]) + dec.close()
        assert got == expected, cut
    dec = SSEDecoder()
    assert sum((dec.feed(bytes([b])) for b in raw), []) == expected  # one byte at a time


def _chunk(tc=None, **delta):
    d = dict(delta)
    if tc is not None:
        d["tool_calls"] = tc
    return {"choices": [{"index": 0, "delta": d}]}


def _run(chunks):
    n = ChunkNormalizer()
    events = [e for c in chunks for e in n.feed(c)] + n.finish()
    return events, n.result


def test_b19_three_id_conventions_give_identical_calls():
    def fn(name=None, args=""):
        return {k: v for k, v in (("name", name), ("arguments", args)) if v is not None}
    a = [_chunk([{"index": 0, "id": "c1", "type": "function", "function": fn("f", "")}]),
         _chunk([{"index": 0, "function": fn(args='{"x":')}]), _chunk([{"index": 0, "function": fn(args="1}")}]),
         _chunk([{"index": 1, "id": "c2", "type": "function", "function": fn("g", "{}")}])]
    b = [_chunk([{"index": 0, "id": "c1", "type": "function", "function": fn("f", "")}]),
         _chunk([{"index": 0, "id": "c1", "function": fn(args='{"x":')}]),
         _chunk([{"index": 0, "id": "c1", "function": fn(args="1}")}]),
         _chunk([{"index": 1, "id": "c2", "function": fn("g", "{}")}])]
    c = [_chunk([{"index": 0, "id": "c1", "function": fn("f", '{"x":')}]), _chunk([{"index": 0, "function": fn(args="1}")}]),
         _chunk([{"index": 0, "id": "c2", "type": "function", "function": fn("g", "{}")}])]
    results = [_run(x) for x in (a, b, c)]
    calls = [[(t.id, t.name, t.arguments) for t in r.tool_calls] for _, r in results]
    assert calls[0] == calls[1] == calls[2] == [("c1", "f", '{"x":1}'), ("c2", "g", "{}")]
    starts = [[e for e in ev if e[0] == "tool_start"] for ev, _ in results]
    assert starts[0] == starts[1] == starts[2] == [("tool_start", 0, "c1", "f"), ("tool_start", 1, "c2", "g")]


def test_arguments_before_the_name_are_held_then_emitted():
    ev, r = _run([_chunk([{"index": 0, "id": "c", "function": {"arguments": '{"a"'}}]),
                  _chunk([{"index": 0, "function": {"name": "f", "arguments": ":1}"}}])])
    assert ev == [("tool_start", 0, "c", "f"), ("tool_args", 0, '{"a"'), ("tool_args", 0, ":1}")]
    assert r.tool_calls[0].parsed_arguments() == {"a": 1}


def test_non_stream_reads_vllm_extensions_and_both_reasoning_names():
    for field in ("reasoning", "reasoning_content"):
        r = result_from_completion({"prompt_token_ids": [1, 2], "policy_version": 4, "choices": [{
            "message": {"content": "hi", field: "why"}, "finish_reason": "stop", "stop_reason": "END",
            "token_ids": [5, 6], "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]}}]})
        assert (r.reasoning, r.text, r.prompt_ids, r.sampled_ids, r.logprobs) == ("why", "hi", [1, 2], [5, 6],
                                                                                  [-0.1, -0.2])
        assert r.policy_version == 4 and r.stop_sequence == "END"


@pytest.mark.parametrize("msg,expected", [
    ("This model's maximum context length is 8192 tokens. However, you requested 9000 tokens (8000 in the "
     "messages, 1000 in the completion). Please reduce the length of the messages or completion.", (8000, 8192)),
    ("This model's maximum context length is 4096 tokens. However, your request has 5000 input tokens. Please "
     "reduce the length of the input messages.", (5000, 4096)),
    ("'max_tokens' is too large: 8000. This model's maximum context length is 8192 tokens and your request has "
     "2000 input tokens (8000 > 8192 - 2000).", (2000, 8192)),
    ("something else entirely", None)])
def test_vllm_context_wordings_are_recognised(msg, expected):
    assert parse_context_overflow(msg) == expected


def test_context_overflow_wording_per_api():
    err = GatewayError("context_length", "x", prompt_tokens=9000, max_context=8192)
    assert error_body("anthropic", err)["error"]["message"] == "prompt is too long: 9000 tokens > 8192 maximum"
    assert error_body("chat", err)["error"]["code"] == "context_length_exceeded"
    assert error_body("gemini", err)["error"] == {
        "code": 400, "status": "INVALID_ARGUMENT",
        "message": "The input token count (9000) exceeds the maximum number of tokens allowed (8192)."}


@pytest.mark.parametrize("api", APIS)
def test_multibyte_characters_split_across_tcp_reads(gw, episode, api):
    """The engine's SSE bytes arrive one byte per read, splitting every
    multi-byte character; the client still gets the exact text (no U+FFFD)."""
    _, token = episode
    a = ask(gw, token, api, True, "x " + directive({"text": TEXT, "split_bytes": True}))
    assert a.text == TEXT and "\ufffd" not in a.raw.decode("utf-8")


def test_gateway_imports_no_ml_stack():
    """The gateway runs on small CPU boxes: building its app must not import torch/transformers
    (of the engine package it uses only the HTTP client, the SSE parser, the disconnect probe, the
    adapter names of `lora_format` and the numpy-only routed-experts codecs, `routed` and `route_bytes`)."""
    import subprocess
    import sys
    code = ("import sys; from app.proxy import create_gateway_app; create_gateway_app(); "
            "light = ('app.engines', 'app.engines.client', 'app.engines.errors', 'app.engines.transport', 'app.engines.stream', 'app.engines.answer', 'app.engines.connections', 'app.engines.http1', 'app.engines.socket_wait', 'app.engines.transform', 'app.engines.sse', 'app.engines.disconnect', 'app.engines.lora_format', "
            "'app.engines.routed', 'app.engines.route_bytes'); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'app')"
            " and m.startswith(('torch', 'transformers', 'app.training', 'app.engines')) and m not in light];"
            " print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("field, value", [("temperature", float("nan")), ("temperature", float("inf")),
                                          ("temperature", -0.5), ("top_p", float("nan")), ("top_p", 1.5),
                                          ("presence_penalty", 9.0)])
def test_non_finite_or_out_of_range_sampling_is_the_callers_400(field, value):
    """`"temperature": NaN` (JSON parsers accept it) must never reach a shared engine batch."""
    import math

    from app.engines.embedded.validation import EngineError, sampling_params
    from app.proxy import chat

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(GatewayError) as info:
        chat.normalize(body)
    assert info.value.status == 400 and field in str(info.value)
    if field in ("temperature", "top_p") and not math.isfinite(value):
        with pytest.raises(EngineError) as engine_info:  # the engine checks it too, for direct callers
            sampling_params({field: value})
        assert engine_info.value.status == 400 and engine_info.value.param == field
