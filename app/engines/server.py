"""HTTP server of the embedded CPU engine: a vLLM-compatible subset of the OpenAI API.

Run:  ``python -m app.engines.server --model smollm2 --port 8200``  (``tiny`` or a checkpoint dir also work)
or under gunicorn (one process owns the model; threads serve the streams)::

    TURNSTILE_ENGINE_MODEL=smollm2 gunicorn -w 1 -k gthread --threads 64 -b :8200 \\
        'app.engines.server:create_engine_app()'

Routes (shapes follow vLLM's OpenAI server, https://docs.vllm.ai/en/latest/serving/openai_compatible_server/):

* ``POST /v1/chat/completions``: stream and non-stream; ``prompt_token_ids`` (a prompt given as ids,
  used instead of rendering ``messages``); vLLM extensions ``return_token_ids``,
  ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
  ``return_tokens_as_token_ids``, ``chat_template_kwargs``; Turnstile adds ``policy_version`` and
  ``engine_id`` to every response and chunk.  ``n`` must be 1.  ``presence_penalty``,
  ``frequency_penalty``, ``logit_bias`` and ``response_format`` are accepted and ignored.
* ``POST /v1/completions``: legacy completions with ``prompt`` as a string or a list of token ids
  (the "tokens in, tokens out" path: the caller renders the template, no re-tokenization).
* ``POST /tokenize`` / ``POST /detokenize``, ``GET /v1/models``, ``GET /health``.
* ``POST /v1/load_weights {"path", "policy_version"}`` → ``{"policy_version"}`` and
  ``GET /v1/policy_version``: see ``BatchScheduler.reload`` for the in-flight rule.  Loading
  weights is an admin route: it needs ``Authorization: Bearer <API token>`` (``app.auth``; 401
  otherwise), which ``EngineClient.reload`` / ``reset_to_base`` send.

Errors use vLLM's body ``{"error": {"message", "type", "param", "code"}}``; a context overflow
uses vLLM's wording ("This model's maximum context length is 8192 tokens. However, you
requested N tokens (P in the messages, M in the completion). …") so harnesses recognise it.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from app.engines.batching import BatchScheduler, Failed, GenerationRequest, Started, TokenEvent
from app.engines.disconnect import client_gone_probe
from app.engines.modeling import load_model, read_metadata, read_state_dict
from app.engines.outputs import (
    ChatOptions,
    ChoiceAssembler,
    ChunkBuilder,
    TokenTexts,
    build_response,
    completion_choice,
    completion_object,
    new_completion_id,
    usage,
)
from app.engines.templates import TemplateError, render_prompt
from app.engines.validation import (
    EngineError,
    get_field,
    json_body,
    resolve_max_tokens,
    sampling_params,
    stop_strings,
)

log = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 8192
EVENT_TIMEOUT_S = 3600.0  # a queued request may wait behind long generations


@dataclass
class Engine:
    """Model + tokenizer + scheduler of one engine process."""

    model: Any
    tokenizer: Any
    scheduler: BatchScheduler
    model_spec: str
    served_model_name: str
    engine_id: str
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    tokenizer_lock: Any = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.tokenizer, self.tokenizer_lock)
        self.stop_token_ids = frozenset(
            t for t in {self.tokenizer.eos_token_id, self.tokenizer.convert_tokens_to_ids("<|endoftext|>")}
            if isinstance(t, int) and t >= 0)


def build_engine(model_spec: str, *, max_batch: int = 8, prefill_chunk: int = 512,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN, served_model_name: str | None = None,
                 engine_id: str | None = None, policy_version: int | None = None,
                 threads: int | None = None, prefix_cache_tokens: int = 16384) -> Engine:
    """Load the model and start the scheduler thread.

    ``policy_version`` defaults to the checkpoint's ``turnstile.json`` value, else 0.
    ``threads`` (torch intra-op threads) defaults to the ``TURNSTILE_ENGINE_THREADS`` setting (1): on a
    shared box OpenMP's spinning barriers make 2 threads up to 10x slower whenever another
    process holds a core; raise it only where the engine owns its cores.
    """
    if threads is None:
        from app.config import get_settings

        threads = get_settings().engine_threads
    torch.set_num_threads(threads)
    started = time.perf_counter()
    model, tokenizer = load_model(model_spec)
    log.info("loaded model %s in %.2fs", model_spec, time.perf_counter() - started)
    if policy_version is None:
        policy_version = int(read_metadata(model_spec).get("policy_version", 0)) if os.path.isdir(model_spec) else 0
    scheduler = BatchScheduler(model, max_batch=max_batch, prefill_chunk=prefill_chunk,
                               policy_version=policy_version, prefix_cache_tokens=prefix_cache_tokens).start()
    return Engine(model, tokenizer, scheduler, model_spec,
                  served_model_name or ("SmolLM2-135M-Instruct" if model_spec == "smollm2" else f"turnstile-{os.path.basename(model_spec.rstrip('/'))}"),
                  engine_id or f"embedded-{socket.gethostname()}-{os.getpid()}", max_model_len)


# ---------------------------------------------------------------- request parsing
def _render(engine: Engine, body: dict, default_generation_prompt: bool = True) -> list[int]:
    tools = body.get("tools")
    kwargs = get_field(body, "chat_template_kwargs", dict, {})
    with engine.tokenizer_lock:
        try:
            return render_prompt(engine.tokenizer, body.get("messages"), tools,
                                 get_field(body, "add_generation_prompt", bool, default_generation_prompt), kwargs,
                                 continue_final_message=get_field(body, "continue_final_message", bool, False))
        except TemplateError as exc:
            raise EngineError(str(exc), param="messages") from exc


def _given_prompt(engine: Engine, body: dict) -> list[int] | None:
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
        if assembler.finished:
            break
    return deltas, version


# ---------------------------------------------------------------- chat completions
def _chat(engine: Engine) -> Response:
    body = json_body()
    if get_field(body, "n", int, 1) != 1:
        raise EngineError("only n=1 is supported", param="n")
    prompt_ids = _given_prompt(engine, body)
    if prompt_ids is None:
        prompt_ids = _render(engine, body)
    max_tokens = resolve_max_tokens(body, len(prompt_ids), engine.max_model_len)
    params = sampling_params(body)
    stop_ids = set() if get_field(body, "ignore_eos", bool, False) else set(engine.stop_token_ids)
    extra_stops = get_field(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in extra_stops):
        raise EngineError("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    stop_ids |= set(extra_stops)
    stream_options = get_field(body, "stream_options", dict, {})
    options = ChatOptions(
        model=get_field(body, "model", str, engine.served_model_name) or engine.served_model_name,
        stop=stop_strings(body), logprobs=params.top_logprobs > 0 or get_field(body, "logprobs", bool, False),
        top_logprobs=params.top_logprobs, return_token_ids=get_field(body, "return_token_ids", bool, False),
        return_tokens_as_token_ids=get_field(body, "return_tokens_as_token_ids", bool, False),
        skip_special_tokens=get_field(body, "skip_special_tokens", bool, True),
        parse_tools=bool(body.get("tools")) and body.get("tool_choice") != "none",
        include_usage=bool(stream_options.get("include_usage")))
    req = engine.scheduler.submit(GenerationRequest(prompt_ids, max_tokens, params, frozenset(stop_ids)))
    assembler = ChoiceAssembler(engine.tokenizer, engine.texts, options)
    if get_field(body, "stream", bool, False):
        return Response(_stream(engine, req, assembler, options, prompt_ids), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        deltas, version = _collect(req, assembler)
        return jsonify(build_response(options, prompt_ids, deltas, version, engine.engine_id))
    except ClientLeft:
        return _client_left()
    finally:
        req.cancel()


def _client_left() -> Response:
    log.info("client closed its connection; non-stream request cancelled")
    return Response(status=499)  # nobody reads it


def _completion_prompt(engine: Engine, body: dict) -> list[int]:
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


def _completions(engine: Engine) -> Response:
    """``POST /v1/completions``: the tokens-in path (prompt ids rendered by the caller, no template)."""
    body = json_body()
    if get_field(body, "n", int, 1) != 1:
        raise EngineError("only n=1 is supported", param="n")
    if get_field(body, "echo", bool, False):
        raise EngineError("'echo' is not supported", param="echo")
    prompt_ids = _completion_prompt(engine, body)
    max_tokens = resolve_max_tokens(body, len(prompt_ids), engine.max_model_len)
    top = get_field(body, "logprobs", int)
    if top is not None and not 0 <= top <= 20:
        raise EngineError("'logprobs' must be between 0 and 20", param="logprobs")
    params = sampling_params({**body, "logprobs": top is not None, "top_logprobs": top or 0})
    stop_ids = set() if get_field(body, "ignore_eos", bool, False) else set(engine.stop_token_ids)
    options = ChatOptions(model=get_field(body, "model", str, engine.served_model_name) or engine.served_model_name,
                          stop=stop_strings(body), logprobs=top is not None, top_logprobs=top or 0,
                          return_token_ids=get_field(body, "return_token_ids", bool, False),
                          skip_special_tokens=get_field(body, "skip_special_tokens", bool, True),
                          include_usage=bool(get_field(body, "stream_options", dict, {}).get("include_usage")))
    req = engine.scheduler.submit(GenerationRequest(prompt_ids, max_tokens, params, frozenset(stop_ids)))
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
                yield version, assembler.add(event)

    if not get_field(body, "stream", bool, False):
        try:
            deltas, version = _collect(req, assembler)
            out = completion_object(options, completion_id, created, version, engine.engine_id,
                                    [completion_choice(options, deltas)])
            out["usage"] = usage(len(prompt_ids), len(assembler.token_ids))
            if options.return_token_ids:
                out["prompt_token_ids"] = prompt_ids
            return jsonify(out)
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
            elif isinstance(event, TokenEvent):
                chunk = builder.delta(assembler.add(event))
                if chunk is not None:
                    yield _sse(chunk)
        if builder is not None and assembler.finished and options.include_usage:
            yield _sse(builder.usage_chunk(len(assembler.token_ids)))
        yield "data: [DONE]\n\n"
    finally:
        req.cancel()  # client gone or stop string: free the batch slot


# ---------------------------------------------------------------- app factory
def create_engine_app(model_spec: str | None = None, engine: Engine | None = None, *,
                      admin_token: str | None = None, **engine_kwargs) -> Flask:
    """Flask app serving one engine.  Loads ``model_spec`` (default: the ``TURNSTILE_ENGINE_MODEL``
    setting, ``smollm2``) unless a ready ``engine`` is given.  ``admin_token`` guards the admin
    routes (default: the deployment's API token, ``app.auth.api_token()``)."""
    from app import auth

    if engine is None:
        from app.config import get_settings

        engine = build_engine(model_spec or get_settings().engine_model, **engine_kwargs)
    token = admin_token or auth.api_token()
    app = Flask("turnstile-engine")
    app.config["ENGINE"] = engine

    def require_admin() -> None:
        """Raise a 401 unless the request carries the API token as a bearer credential."""
        if not auth.same(auth.bearer(request.headers.get("Authorization")), token):
            raise EngineError("loading weights needs the API token (Authorization: Bearer <token>)", 401)

    @app.errorhandler(EngineError)
    def _engine_error(exc: EngineError):
        return jsonify(exc.body()), exc.status

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        return jsonify(EngineError(exc.description or exc.name, exc.code or 500).body()), exc.code or 500

    @app.errorhandler(Exception)
    def _internal_error(exc: Exception):
        log.exception("unhandled engine error")
        return jsonify(EngineError(f"internal engine error: {exc}", 500).body()), 500

    @app.post("/v1/chat/completions")
    def chat_completions():
        return _chat(engine)

    @app.post("/v1/completions")
    def completions():
        return _completions(engine)

    @app.post("/tokenize")
    def tokenize():
        body = json_body()
        if "messages" in body:
            ids = _render(engine, body)
        elif isinstance(body.get("prompt"), str):
            with engine.tokenizer_lock:
                ids = engine.tokenizer(body["prompt"], add_special_tokens=get_field(body, "add_special_tokens", bool, True))["input_ids"]
        else:
            raise EngineError("give 'messages' or a string 'prompt'")
        out = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": list(ids)}
        if get_field(body, "return_token_strs", bool, False):
            with engine.tokenizer_lock:
                out["token_strs"] = engine.tokenizer.convert_ids_to_tokens(list(ids))
        return jsonify(out)

    @app.post("/detokenize")
    def detokenize():
        tokens = get_field(json_body(), "tokens", list)
        if tokens is None or not all(isinstance(t, int) and 0 <= t < len(engine.tokenizer) for t in tokens):
            raise EngineError("'tokens' must be a list of token ids", param="tokens")
        with engine.tokenizer_lock:
            return jsonify({"prompt": engine.tokenizer.decode(tokens)})

    @app.get("/v1/models")
    def models():
        return jsonify({"object": "list", "data": [{
            "id": engine.served_model_name, "object": "model", "created": 0, "owned_by": "turnstile",
            "root": engine.model_spec, "max_model_len": engine.max_model_len,
            "policy_version": engine.scheduler.policy_version}]})

    @app.get("/health")
    def health():
        return jsonify({"status": "ok", "engine_id": engine.engine_id, **engine.scheduler.load()})

    @app.get("/v1/policy_version")
    def policy_version():
        return jsonify({"policy_version": engine.scheduler.policy_version, "engine_id": engine.engine_id})

    @app.post("/v1/load_weights")
    def load_weights():
        require_admin()
        body = json_body()
        started = time.perf_counter()
        if get_field(body, "base", bool, False):
            # Back to the weights this engine was started with (a run that starts from the base
            # model must not sample from a previous run's trained weights).
            path = engine.model_spec
            version = get_field(body, "policy_version", int, 0)
            state = load_model(engine.model_spec)[0].state_dict()
        else:
            path = get_field(body, "path", str)
            if not path or not os.path.isdir(path):
                raise EngineError(f"checkpoint directory {path!r} does not exist", param="path")
            version = get_field(body, "policy_version", int, engine.scheduler.policy_version + 1)
            try:
                state = read_state_dict(path)  # disk I/O here, not on the scheduler thread
            except Exception as exc:  # safetensors raises its own SafetensorError on corrupt files
                raise EngineError(f"cannot read checkpoint {path}: {exc}", param="path") from exc
        try:
            new_version = engine.scheduler.reload(state, version)
        except (ValueError, RuntimeError) as exc:
            raise EngineError(f"checkpoint does not fit the served model: {exc}", param="path") from exc
        return jsonify({"policy_version": new_version, "path": path, "engine_id": engine.engine_id,
                        "load_s": round(time.perf_counter() - started, 3)})

    return app


def main(argv: list[str] | None = None) -> None:
    from app.config import get_settings

    settings = get_settings()
    parser = argparse.ArgumentParser(description="Turnstile embedded CPU inference engine")
    parser.add_argument("--model", default=settings.engine_model,
                        help="tiny | smollm2 | checkpoint directory (default: TURNSTILE_ENGINE_MODEL, smollm2)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=settings.engine_port, help="default: TURNSTILE_ENGINE_PORT, 8200")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    parser.add_argument("--prefix-cache-tokens", type=int, default=16384, help="prefix cache budget (0: off)")
    parser.add_argument("--served-model-name")
    parser.add_argument("--engine-id")
    parser.add_argument("--policy-version", type=int)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: TURNSTILE_ENGINE_THREADS, 1)")
    args = parser.parse_args(argv)
    faulthandler.enable()  # a hard crash (signal) leaves a traceback of every thread in the log
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_engine_app(args.model, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk,
                            max_model_len=args.max_model_len, served_model_name=args.served_model_name,
                            engine_id=args.engine_id or f"embedded-{socket.gethostname()}-{args.port}",
                            policy_version=args.policy_version, threads=args.threads,
                            prefix_cache_tokens=args.prefix_cache_tokens)
    from werkzeug.serving import make_server

    server = make_server(args.host, args.port, app, threaded=True)
    log.info("engine %s serving %s on http://%s:%d", app.config["ENGINE"].engine_id, args.model, args.host, args.port)
    server.serve_forever()


if __name__ == "__main__":
    main()
