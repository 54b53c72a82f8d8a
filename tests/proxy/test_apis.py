"""The API modules' declared interface (`app.proxy.apis.ApiModule`) and their shared behaviour."""
from __future__ import annotations

import inspect
import json
import typing

import pytest

from app.proxy import apis
from app.proxy.canonical import Result, ToolCall
from app.proxy.common import CallContext
from app.proxy.detect import APIS
from app.proxy.errors import GatewayError

MODULES = sorted(apis.REGISTRY.items())
BODIES = {"anthropic": {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]},
          "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
          "responses": {"model": "m", "input": "hi"},
          "gemini": {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}}


def _declared(protocol: type) -> dict[str, object]:
    """The members a Protocol declares: its annotations and its public methods."""
    names = set(typing.get_type_hints(protocol)) | {
        n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_")}
    return {n: getattr(protocol, n, None) for n in names}


def _same_signature(impl, declared, drop_self: bool) -> None:
    want = inspect.signature(declared)
    params = list(want.parameters.values())[1:] if drop_self else list(want.parameters.values())
    got = inspect.signature(impl)
    got_params = list(got.parameters.values())
    if not drop_self:  # methods compared with methods: both keep self
        params, got_params = params[1:], got_params[1:]
    assert [(p.name, p.kind, p.default) for p in got_params] == [(p.name, p.kind, p.default) for p in params], impl
    want_hints = typing.get_type_hints(declared)
    got_hints = typing.get_type_hints(impl)
    want_hints.pop("self", None)
    assert got_hints == want_hints, impl


def test_the_registry_holds_every_routed_api_under_its_own_name():
    assert set(apis.REGISTRY) == set(APIS)
    for name, module in apis.REGISTRY.items():
        assert module.API == name
    assert apis.api_module("no such api") is apis.FALLBACK


@pytest.mark.parametrize("name,module", MODULES)
def test_every_registered_module_satisfies_the_protocol(name, module):
    """Same names, same signatures and annotations as `ApiModule`; its Stream as `StreamWriter`."""
    hints = typing.get_type_hints(apis.ApiModule)
    for member, declared in _declared(apis.ApiModule).items():
        assert hasattr(module, member), f"{name} lacks {member}"
        impl = getattr(module, member)
        if inspect.isfunction(declared):
            assert inspect.isfunction(impl), f"{name}.{member} is not a function"
            _same_signature(impl, declared, drop_self=True)
        elif member == "Stream":
            assert inspect.isclass(impl)
        else:
            assert isinstance(impl, hints[member]), f"{name}.{member}: expected {hints[member]}"
    writer = module.Stream(module.normalize(BODIES[name]), "id1")
    for member, declared in _declared(apis.StreamWriter).items():
        assert hasattr(writer, member), f"{name}.Stream lacks {member}"
        if inspect.isfunction(declared):
            _same_signature(getattr(module.Stream, member), declared, drop_self=False)
    # the relay builds every writer as Stream(norm, resp_id)
    assert list(inspect.signature(module.Stream).parameters) == ["norm", "resp_id"]


@pytest.mark.parametrize("name,module", MODULES)
def test_an_answer_reads_back_as_the_engine_message_it_was_rendered_from(name, module):
    """`answer_of(render(r))` is the assistant message of `r` in the engine's Chat form: what the
    splice compares and the dashboard shows."""
    norm = module.normalize(BODIES[name], CallContext(model="m"))
    r = Result(text="Reading it.", tool_calls=[ToolCall("call_1", "read", '{"path": "a.py"}')],
               finish_reason="tool_calls")
    answer = module.answer_of(module.render(r, norm, module.response_id()))
    assert answer["role"] == "assistant" and answer["content"] == "Reading it."
    (call,) = answer["tool_calls"]
    assert call["function"]["name"] == "read" and json.loads(call["function"]["arguments"]) == {"path": "a.py"}
    assert module.answer_of(None) is None and module.answer_of({"unrelated": 1}) is None


@pytest.mark.parametrize("name,module", MODULES)
def test_response_ids_are_fresh_and_errors_take_the_apis_shape(name, module):
    a, b = module.response_id(), module.response_id()
    assert a != b and a.startswith({"anthropic": "msg_", "chat": "chatcmpl-", "responses": "resp_", "gemini": ""}[name])
    body = module.error_body(GatewayError("not_found", "nope"))
    assert "nope" in json.dumps(body)
    assert module.model_body("m") == module.models_body(["m"])[{"gemini": "models"}.get(name, "data")][0]


def test_token_counts_are_offered_where_the_api_has_an_endpoint():
    assert apis.REGISTRY["anthropic"].count_body(7) == {"input_tokens": 7}
    assert apis.REGISTRY["gemini"].count_body(7) == {"totalTokens": 7}
    for name in ("chat", "responses"):
        with pytest.raises(GatewayError) as exc:
            apis.REGISTRY[name].count_body(7)
        assert exc.value.status == 404


def test_counting_reads_geminis_wrapped_request_and_skips_sampling_fields():
    gemini, anthropic = apis.REGISTRY["gemini"], apis.REGISTRY["anthropic"]
    wrapped = {"generateContentRequest": {"contents": [{"role": "user", "parts": [{"text": "count me"}]}]}}
    norm = gemini.normalize(wrapped, CallContext(model="models/g", count_only=True))
    assert norm.chat["messages"] == [{"role": "user", "content": "count me"}] and norm.model == "g"
    # count_tokens bodies carry no max_tokens: counting must not ask for it
    norm = anthropic.normalize({"model": "c", "messages": [{"role": "user", "content": "x"}]},
                               CallContext(count_only=True))
    assert "max_tokens" not in norm.chat
    with pytest.raises(GatewayError):
        anthropic.normalize({"model": "c", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1})


def test_a_previous_response_is_read_through_the_context():
    responses = apis.REGISTRY["responses"]
    earlier = [{"role": "user", "content": "first"},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "one"}]}]
    seen = []

    def history(response_id: str) -> list:
        seen.append(response_id)
        if response_id != "resp_1":
            raise LookupError(response_id)
        return earlier

    norm = responses.normalize({"model": "m", "input": "second", "previous_response_id": "resp_1"},
                               CallContext(history=history))
    assert [m["content"] for m in norm.chat["messages"]] == ["first", "one", "second"] and seen == ["resp_1"]
    with pytest.raises(GatewayError, match="not found") as exc:
        responses.normalize({"model": "m", "input": "x", "previous_response_id": "resp_2"},
                            CallContext(history=history))
    assert exc.value.param == "previous_response_id"
    with pytest.raises(GatewayError, match="expected a string"):
        responses.normalize({"model": "m", "input": "x", "previous_response_id": 3}, CallContext(history=history))
