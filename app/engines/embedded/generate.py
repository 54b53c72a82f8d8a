"""The embedded engine's generation routes: `POST /v1/chat/completions` (`chat`) and
`POST /v1/completions` (`completions`), stream and non-stream, with the prompt built from the
request (`render`, `given_prompt`, `completion_prompt`).

A non-stream request watches its client while it waits (`collect`): a client that closes its
connection frees its batch slot instead of the engine generating to `max_tokens` for nobody.
A stream's generator cancels the request when the client goes (WSGI closes it).
Shapes and error bodies: see `app.engines.embedded.server`.
"""
from __future__ import annotations

import json
import logging
import queue
import time
from typing import Iterator

from flask import Response, jsonify, request

from app.engines.disconnect import client_gone_probe
from app.engines.embedded import adapters
from app.engines.embedded.events import Aborted, Failed, GenerationRequest, Started, TokenEvent
from app.engines.embedded.engine import Engine
from app.engines.embedded.outputs import (
    ChatOptions,
    ChoiceAssembler,
    ChunkBuilder,
    build_response,
    completion_choice,
    completion_object,
    new_completion_id,
    usage,
    version_fields,
)
from app.engines.embedded.routes import routes_of
from app.engines.embedded.templates import TemplateError, render_prompt
from app.engines.embedded.validation import EngineError, get_field, json_body, resolve_max_tokens, sampling_params, stop_strings

log = logging.getLogger(__name__)
EVENT_TIMEOUT_S = 3600.0  # a queued request may wait behind long generations


# ---------------------------------------------------------------- request parsing
def render(engine: Engine, body: dict, default_generation_prompt: bool = True) -> list[int]:
    """Prompt token ids of a request's ``messages`` (and ``tools``) in the engine's chat template.

    Raises:
        EngineError: the messages cannot be rendered (400, ``param`` "messages").
    """
    tools = body.get("tools")
    kwargs = get_field(body, "chat_template_kwargs", dict, {})
    with engine.tokenizer_lock:
        try:
            return render_prompt(engine.tokenizer, body.get("messages"), tools,
                                 get_field(body, "add_generation_prompt", bool, default_generation_prompt), kwargs,
                                 continue_final_message=get_field(body, "continue_final_message", bool, False))
        except TemplateError as exc:
            raise EngineError(str(exc), param="messages") from exc


def given_prompt(engine: Engine, body: dict) -> list[int] | None:
    """``prompt_token_ids`` of a chat request (tokens in: the gateway's spliced prompt; vLLM 0.32
    reads the same ids from ``kv_transfer_params.prompt_token_ids``): used verbatim instead of
    rendering ``messages``, which still name the tools the answer is parsed for.  None when absent.

    Raises:
        EngineError: the field is not a non-empty list of ids of this tokenizer (400).
    """
    ids = body.get("prompt_token_ids")
    if ids is None:
        return None
    if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool)
                                                  and 0 <= t < len(engine.tokenizer) for t in ids)):
        raise EngineError("'prompt_token_ids' must be a non-empty list of valid token ids", param="prompt_token_ids")
    return ids


def extra_stop_ids(body: dict) -> set[int]:
    """vLLM's ``stop_token_ids``: ids that end generation besides the model's own stop tokens
    (kept with ``ignore_eos`` too, as in vLLM).

    Raises:
        EngineError: the field is not a list of integers (400, ``param`` "stop_token_ids").
    """
    extra = get_field(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in extra):
        raise EngineError("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    return set(extra)


def _next_event(req: GenerationRequest):
    try:
        return req.events.get(timeout=EVENT_TIMEOUT_S)
    except queue.Empty:
        return Failed(f"engine produced nothing for {EVENT_TIMEOUT_S:.0f}s")


WATCH_S = 0.25  # how often a non-stream request looks for a departed client


def _watched_events(req: GenerationRequest) -> Iterator:
    """`req`'s events for a non-stream answer, ending early (None) when the client has closed its
    connection: checked every WATCH_S seconds whether or not tokens arrive, so a client that
    gives up frees its batch slot instead of the engine generating to max_tokens for nobody."""
    gone = client_gone_probe(request.environ)
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    checked = time.monotonic()
    while True:
        try:
            event = req.events.get(timeout=WATCH_S)
            deadline = time.monotonic() + EVENT_TIMEOUT_S
        except queue.Empty:
            event = None
            if time.monotonic() >= deadline:
                event = Failed(f"engine produced nothing for {EVENT_TIMEOUT_S:.0f}s")
        if time.monotonic() - checked >= WATCH_S:
            checked = time.monotonic()
            if gone():
                yield None
                return
        if event is not None:
            yield event


class ClientLeft(Exception):
    """The client of a non-stream request closed its connection before the answer was ready."""


def _collect(req: GenerationRequest, assembler: ChoiceAssembler) -> tuple[list, int | None]:
    """(deltas, policy version) of a whole non-stream answer, read while watching the client.

    Raises:
        ClientLeft: the client closed its connection (the caller cancels `req`).
        EngineError: generation failed (500).
    """
    deltas, version = [], None
    for event in _watched_events(req):
        if event is None:
            raise ClientLeft()
        if isinstance(event, Started):
            version = event.policy_version
        elif isinstance(event, Failed):
            raise EngineError(event.message, status=500)
        elif isinstance(event, TokenEvent):
            deltas.append(assembler.add(event))
        elif isinstance(event, Aborted):
            deltas.append(assembler.abort())
        if assembler.finished:
            break
    return deltas, version


# ---------------------------------------------------------------- chat completions
def chat(engine: Engine) -> Response:
    """``POST /v1/chat/completions`` on the current Flask request: a JSON response, an SSE stream,
    or 499 when a non-stream client left.  Raises ``EngineError`` for a bad request (400)."""
    body = json_body()
    if get_field(body, "n", int, 1) != 1:
        raise EngineError("only n=1 is supported", param="n")
    prompt_ids = given_prompt(engine, body)
    if prompt_ids is None:
        prompt_ids = render(engine, body)
    max_tokens = resolve_max_tokens(body, len(prompt_ids), engine.max_model_len)
    params = sampling_params(body)
    stop_ids = set() if get_field(body, "ignore_eos", bool, False) else set(engine.stop_token_ids)
    stop_ids |= extra_stop_ids(body)
    stream_options = get_field(body, "stream_options", dict, {})
    options = ChatOptions(
        model=get_field(body, "model", str, engine.served_model_name) or engine.served_model_name,
        stop=stop_strings(body), logprobs=params.top_logprobs > 0 or get_field(body, "logprobs", bool, False),
        top_logprobs=params.top_logprobs, return_token_ids=get_field(body, "return_token_ids", bool, False),
        return_routed_experts=get_field(body, "return_routed_experts", bool, False),
        return_tokens_as_token_ids=get_field(body, "return_tokens_as_token_ids", bool, False),
        skip_special_tokens=get_field(body, "skip_special_tokens", bool, True),
        parse_tools=bool(body.get("tools")) and body.get("tool_choice") != "none",
        include_usage=bool(stream_options.get("include_usage")))
    req = engine.scheduler.submit(GenerationRequest(prompt_ids, max_tokens, params, frozenset(stop_ids),
                                                    adapter=adapters.request_adapter(engine, body)))
    assembler = ChoiceAssembler(engine.tokenizer, engine.texts, options)
    if get_field(body, "stream", bool, False):
        return Response(_stream(engine, req, assembler, options, prompt_ids), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        deltas, version = _collect(req, assembler)
        out = build_response(options, prompt_ids, deltas, version, engine.engine_id)
        return jsonify({**out, **routed_experts(options, assembler, prompt_ids)})
    except ClientLeft:
        return _client_left()
    finally:
        req.cancel()


def routed_experts(options: ChatOptions, assembler: ChoiceAssembler, prompt_ids: list[int]) -> dict:
    """``{"routed_experts": ids}`` when asked for and the model is a mixture of experts, else ``{}``.

    ``ids`` is ``[tokens][layers][top_k]`` expert ids (the shape of vLLM's ``routed_experts``) of
    the prompt and every sampled token but the last, which never ran through the model.
    """
    if not options.return_routed_experts or assembler.route_blocks is None or not assembler.token_ids:
        return {}
    return {"routed_experts": routes_of(assembler.route_blocks, len(prompt_ids) + len(assembler.token_ids) - 1).tolist()}


def _client_left() -> Response:
    log.info("client closed its connection; non-stream request cancelled")
    return Response(status=499)  # nobody reads it


def completion_prompt(engine: Engine, body: dict) -> list[int]:
    """``prompt`` as a string (tokenized, special tokens added) or one list of token ids (used verbatim)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        with engine.tokenizer_lock:
            return list(engine.tokenizer(prompt, add_special_tokens=get_field(body, "add_special_tokens", bool, True))["input_ids"])
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < len(engine.tokenizer) for t in prompt)):
        return prompt
    raise EngineError("'prompt' must be a string or one non-empty list of valid token ids", param="prompt")


def completions(engine: Engine) -> Response:
    """``POST /v1/completions``: the tokens-in path (prompt ids rendered by the caller, no template)."""
    body = json_body()
    if get_field(body, "n", int, 1) != 1:
        raise EngineError("only n=1 is supported", param="n")
    if get_field(body, "echo", bool, False):
        raise EngineError("'echo' is not supported", param="echo")
    prompt_ids = completion_prompt(engine, body)
    max_tokens = resolve_max_tokens(body, len(prompt_ids), engine.max_model_len)
    top = get_field(body, "logprobs", int)
    if top is not None and not 0 <= top <= 20:
        raise EngineError("'logprobs' must be between 0 and 20", param="logprobs")
    params = sampling_params({**body, "logprobs": top is not None, "top_logprobs": top or 0})
    stop_ids = set() if get_field(body, "ignore_eos", bool, False) else set(engine.stop_token_ids)
    stop_ids |= extra_stop_ids(body)
    options = ChatOptions(model=get_field(body, "model", str, engine.served_model_name) or engine.served_model_name,
                          stop=stop_strings(body), logprobs=top is not None, top_logprobs=top or 0,
                          return_token_ids=get_field(body, "return_token_ids", bool, False),
                          return_routed_experts=get_field(body, "return_routed_experts", bool, False),
                          skip_special_tokens=get_field(body, "skip_special_tokens", bool, True),
                          include_usage=bool(get_field(body, "stream_options", dict, {}).get("include_usage")))
    req = engine.scheduler.submit(GenerationRequest(prompt_ids, max_tokens, params, frozenset(stop_ids),
                                                    adapter=adapters.request_adapter(engine, body)))
    assembler = ChoiceAssembler(engine.tokenizer, engine.texts, options)
    completion_id, created = new_completion_id().replace("chatcmpl", "cmpl"), int(time.time())

    def events():
        version = None
        while not assembler.finished:
            event = _next_event(req)
            if isinstance(event, Started):
                version = event.policy_version
                yield version, None
            elif isinstance(event, Failed):
                raise EngineError(event.message, status=500)
            elif isinstance(event, TokenEvent):
                yield event.policy_version, assembler.add(event)
            elif isinstance(event, Aborted):
                yield version, assembler.abort()

    if not get_field(body, "stream", bool, False):
        try:
            deltas, version = _collect(req, assembler)
            out = completion_object(options, completion_id, created, version, engine.engine_id,
                                    [completion_choice(options, deltas)])
            out["usage"] = usage(len(prompt_ids), len(assembler.token_ids))
            out.update(version_fields(deltas))
            if options.return_token_ids:
                out["prompt_token_ids"] = prompt_ids
            return jsonify({**out, **routed_experts(options, assembler, prompt_ids)})
        except ClientLeft:
            return _client_left()
        finally:
            req.cancel()

    def stream() -> Iterator[str]:
        version = None
        try:
            for version, delta in events():
                if delta is None:
                    continue
                chunk = completion_object(options, completion_id, created, version, engine.engine_id,
                                          [completion_choice(options, [delta])])
                if delta.kv_version is not None and delta.kv_version != delta.policy_version:
                    chunk["kv_version"] = delta.kv_version
                if options.return_token_ids and len(assembler.token_ids) == 1:
                    chunk["prompt_token_ids"] = prompt_ids
                yield _sse(chunk)
            if options.include_usage:
                chunk = completion_object(options, completion_id, created, version, engine.engine_id, [])
                chunk["usage"] = usage(len(prompt_ids), len(assembler.token_ids))
                yield _sse(chunk)
        except EngineError as exc:
            yield _sse(exc.body())
        finally:
            req.cancel()
        yield "data: [DONE]\n\n"

    return Response(stream(), mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _stream(engine: Engine, req: GenerationRequest, assembler: ChoiceAssembler, options: ChatOptions,
            prompt_ids: list[int]) -> Iterator[str]:
    """SSE frames; always ends with ``data: [DONE]`` (an error frame first if generation failed)."""
    builder = None
    try:
        while not assembler.finished:
            event = _next_event(req)
            if isinstance(event, Started):
                builder = ChunkBuilder(options, prompt_ids, event.policy_version, engine.engine_id)
                yield _sse(builder.first())
            elif isinstance(event, Failed):
                yield _sse({"error": {"message": event.message, "type": "InternalServerError", "param": None,
                                      "code": 500}})
                break
            elif isinstance(event, (TokenEvent, Aborted)):
                chunk = builder.delta(assembler.add(event) if isinstance(event, TokenEvent) else assembler.abort())
                if chunk is not None:
                    yield _sse(chunk)
        routed = routed_experts(options, assembler, prompt_ids) if assembler.finished else {}
        if builder is not None and routed:  # one chunk after the last token's, as the usage chunk
            yield _sse({**builder._chunk([]), **routed})
        if builder is not None and assembler.finished and options.include_usage:
            yield _sse(builder.usage_chunk(len(assembler.token_ids)))
        yield "data: [DONE]\n\n"
    finally:
        req.cancel()  # client gone or stop string: free the batch slot
