"""The answer relay (`app.proxy.relay`): pieces checked without an engine.  The relay with a real
engine behind it (keep-alives, departed clients, records) is exercised through the gateway in
test_views_*.py."""
from __future__ import annotations

import pytest
from support.gateway_calls import APIS

from app.proxy import relay
from app.proxy.apis import REGISTRY
from app.proxy.canonical import Result
from app.proxy.common import Normalized
from app.proxy.upstream import DONE, EOF


@pytest.mark.parametrize("api", APIS)
def test_a_bug_while_streaming_still_ends_in_the_callers_shape(api):
    """The last guard: an exception escaping a stream's production ends the stream with the
    API's error frames (Responses: response.failed), not a cut chunked body."""
    from support.gateway_grammar import VALIDATORS

    module = REGISTRY[api]
    writer = module.Stream(Normalized(api, {}, "m", True, {"custom_tools": [], "namespaces": {}, "request": {}}),
                           "id1")

    def broken():
        yield from writer.opening()
        raise RuntimeError("a bug")

    raw = b"".join(relay.guarded(broken(), writer, module))
    if api == "anthropic":  # (no usage to report: the validator wants input_tokens > 0)
        assert raw.index(b"event: error") < raw.index(b"event: message_stop") and raw.endswith(b"\n\n")
        return
    rebuilt = VALIDATORS[api](raw)
    if api == "responses":
        assert rebuilt["status"] == "failed" and rebuilt["error"]["code"] == "server_error"
    elif api == "gemini":
        assert rebuilt["error"]["status"] == "INTERNAL"
    else:
        assert rebuilt["error"]


def test_a_stream_that_ends_before_its_finish_reason_is_the_engines_error():
    unfinished, finished = Result(), Result(finish_reason="stop")
    err, done = relay._upstream_item(EOF, unfinished, None)
    assert done and err.kind == "upstream" and "before it finished" in err.message
    assert relay._upstream_item(EOF, finished, None) == (None, True)
    assert relay._upstream_item(DONE, unfinished, None) == (None, True)
    err, done = relay._upstream_item({"object": "error", "message": "out of memory"}, unfinished, None)
    assert done and "out of memory" in err.message
    err, done = relay._upstream_item(ConnectionResetError("reset"), unfinished, None)
    assert done and "reset" in err.message
    assert relay._upstream_item({"choices": []}, unfinished, None) == (None, False)


def test_the_conversations_tool_call_ids_are_taken():
    norm = Normalized("chat", {"messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0"}, {"id": "call_1"}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "ok"}]}, "m", False)
    assert relay.history_call_ids(norm) == {"call_0", "call_1"}
