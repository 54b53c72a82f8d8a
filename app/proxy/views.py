"""HTTP layer of the gateway: route, authenticate, normalize, call the engine, answer, record.

One catch-all route serves every API under any base-URL prefix; `detect` picks the API,
whose module (`app.proxy.apis`) translates the request and the answer.  The body is read
by `app.proxy.body`, the engine's answer relayed and recorded by `app.proxy.relay`.
"""
from __future__ import annotations

import logging
import time

from flask import Flask, Response, request
from werkzeug.exceptions import RequestEntityTooLarge

from app import weight_gate
from app.engines.disconnect import client_gone_probe
from app.engines.lora_format import run_of
from app.proxy import limits, record, relay, splice
from app.proxy.apis import REGISTRY, ApiModule, api_module
from app.proxy.body import read_body
from app.proxy.canonical import ChunkNormalizer
from app.proxy.common import CallContext, Normalized
from app.proxy.detect import Route, api_from_headers, detect
from app.proxy.errors import GatewayError
from app.proxy.settings import gateway_settings
from app.proxy.sessions import SessionInfo, resolve_session_info
from app.proxy.sse import dumps
from app.proxy.upstream import get_upstream

log = logging.getLogger("turnstile.gateway")


def json_response(body: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(dumps(body), status=status, mimetype="application/json", headers=headers)


def error_response(api: str, err: GatewayError) -> Response:
    headers = {"x-should-retry": "true" if err.retryable else "false"}
    return json_response(api_module(api).error_body(err), err.status or 500, headers)


def session_key() -> str | None:
    """The API key as sent by any client: Bearer, x-api-key, x-goog-api-key or ?key=."""
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return (request.headers.get("x-api-key") or request.headers.get("x-goog-api-key")
            or request.args.get("key") or None)


def authenticate() -> SessionInfo:
    info = resolve_session_info(session_key())
    if info is None:
        raise GatewayError("authentication", "Invalid API key: unknown gateway session, or its episode is no "
                                             "longer running")
    return info


def model_ids() -> list[str]:
    up = get_upstream()
    served = [up.describe(e).model for e in up.engines]
    # Claude Code's discovery keeps ids starting with "claude"; Gemini CLI routes by gemini-* names.
    return list(dict.fromkeys([*served, "claude-turnstile", "gpt-turnstile", "gemini-turnstile"]))


def register(app: Flask) -> None:
    app.add_url_rule("/", "root", dispatch, methods=["GET", "HEAD", "POST"], defaults={"path": ""})
    app.add_url_rule("/<path:path>", "dispatch", dispatch, methods=["GET", "HEAD", "POST"])


def dispatch(path: str) -> Response:
    t0 = time.perf_counter()
    api = api_from_headers(request.path, request.headers)
    try:
        if request.method in ("GET", "HEAD"):
            if path.strip("/") in ("", "health", "healthz"):
                return json_response({"status": "ok"})
            route = detect(request.method, request.path, request.headers, None)
            if route is None:
                raise GatewayError("not_found", f"No such endpoint: {request.method} {request.path}")
            api = route.api
            return get_resource(route)
        if _has_control(request.path):  # e.g. /v1/messages%00: no API's path
            raise GatewayError("not_found", f"No such endpoint: POST {request.path!r}")
        if any(_has_control(k) or _has_control(v) for k, v in request.args.items(multi=True)):
            raise GatewayError("invalid_request", "Query parameters must not contain control characters")
        raw, body = read_body(request, gateway_settings().max_body_bytes)
        route = detect("POST", request.path, request.headers, body)
        if route is None:
            raise GatewayError("not_found", f"No such endpoint: POST {request.path}")
        api = route.api
        info = authenticate()
        if route.op == "count_tokens":
            return count_tokens(route, body, info)
        if route.op != "generate":
            raise GatewayError("not_found", f"Unsupported method {route.resource!r} for {request.path}")
        return generate(route, body, raw, info, t0)
    except GatewayError as err:
        return error_response(api, err)
    except RequestEntityTooLarge:
        return error_response(api, GatewayError("too_large", "Request body is too large"))
    except RecursionError:  # JSON nested deep enough to exhaust a recursive step after parsing
        return error_response(api, GatewayError("invalid_request", "Request body is nested too deeply"))
    except Exception:  # noqa: BLE001 - a bug must still answer in the caller's shape, never HTML
        log.exception("gateway error on %s %s", request.method, request.path)
        return error_response(api, GatewayError("internal", "Internal gateway error"))


def get_resource(route: Route) -> Response:
    if route.op == "models":
        return json_response(REGISTRY[route.api].models_body(model_ids()))
    if route.op == "model":
        return json_response(REGISTRY[route.api].model_body(route.model or "default"))
    if route.op == "retrieve":
        info = authenticate()
        found = record.find_response(info.episode_id, route.resource or "")
        if found is None:
            raise GatewayError("not_found", f"Response with id '{route.resource}' not found.")
        return json_response(found[1])
    raise GatewayError("not_found", "No such endpoint")


def count_tokens(route: Route, body: dict, info: SessionInfo) -> Response:
    """The prompt's length in the engine's tokens, as the engine will see it (spliced or rendered)."""
    module = REGISTRY[route.api]
    norm = _normalize(module, route, body, info, count_only=True)
    up = get_upstream()
    engine = up.describe(up.pick(info.episode_id))
    spliced = _splice(info, route.api, up, engine, dict(norm.chat, model=engine.model)).prompt_ids
    if spliced is not None:  # the prompt the engine will see: the sampled ids of earlier turns
        count = len(spliced)
    else:
        tok = {"model": engine.model, "messages": norm.chat["messages"], "add_generation_prompt": True}
        for k in ("tools", "chat_template_kwargs"):
            if k in norm.chat:
                tok[k] = norm.chat[k]
        count = int(up.tokenize(engine, tok).get("count") or 0)
    return json_response(module.count_body(count))


def _normalize(module: ApiModule, route: Route, body: dict, info: SessionInfo, count_only: bool = False) -> Normalized:
    """The request as the engine's Chat request, within the size caps of `app.proxy.limits`: what it
    decodes (reasoning signatures), the history it names (`previous_response_id`) and the engine
    request itself.  Raises GatewayError (400 bad input, 413 past a cap) before anything is asked
    of the engine or recorded."""
    cap = limits.caps().prompt
    ctx = CallContext(model=route.model or "default", stream=route.stream and not count_only, count_only=count_only,
                      history=lambda response_id: record.response_history(info.episode_id, response_id, cap))
    with limits.decoding(cap):
        norm = module.normalize(body, ctx)
    limits.check_prompt(norm.chat, cap)
    return norm


def _has_control(text: str) -> bool:
    """True when `text` holds an ASCII control character (U+0000-U+001F, U+007F): never part of a
    model API's path or query, and U+0000 cannot be recorded (PostgreSQL text)."""
    return any(ch < " " or ch == "\x7f" for ch in text)


MODEL_MAX_CHARS = 255  # the recorded model name's column (`Completion.model`)


def generate(route: Route, body: dict, raw: bytes, info: SessionInfo, t0: float) -> Response:
    """Answer one model call: normalize, splice, ask the engine, answer in the caller's API (a
    JSON body or an SSE stream), record."""
    module = REGISTRY[route.api]
    norm = _normalize(module, route, body, info)
    if len(norm.model or "") > MODEL_MAX_CHARS:  # checked before the engine is asked, never at record time
        raise GatewayError("invalid_request", f"model: at most {MODEL_MAX_CHARS} characters", param="model")
    other = run_of(norm.model)
    if other is not None and other != info.run_id:  # a session samples from its own run's adapter only
        raise GatewayError("invalid_request", f"model: {norm.model!r} is the LoRA adapter of run {other}; this "
                                              f"session belongs to run {info.run_id}", param="model")
    up = get_upstream()
    engine = up.describe(up.pick(info.episode_id))
    # A LoRA run's episodes sample from its own adapter on the shared base (app.engines.embedded.adapters).
    upstream_body = dict(norm.chat, model=info.adapter or engine.model, stream=norm.stream, return_token_ids=True,
                         logprobs=True)
    if engine.asks_routes:
        # An MoE policy's routed experts, recorded with the completion for routing replay
        # (`record._routes`); never part of the client's answer.
        upstream_body["return_routed_experts"] = True
    spliced = _splice(info, route.api, up, engine, upstream_body)
    if spliced.prompt_ids is not None:
        # Tokens in: the engine takes these ids as the prompt (it still reads `messages` to
        # parse its answer); the field is dropped from the record once the engine has the
        # request, since the engine's own `prompt_token_ids` are recorded as `prompt_ids`.
        upstream_body["prompt_token_ids"] = spliced.prompt_ids
        # vLLM's chat route (0.32) does not read a top-level `prompt_token_ids`; it takes the
        # prompt as ids from `kv_transfer_params.prompt_token_ids` (its disaggregated-prefill
        # field).  The embedded and scripted engines read the top-level field and ignore this one.
        upstream_body["kv_transfer_params"] = {"prompt_token_ids": spliced.prompt_ids}
    if norm.stream:
        # Usage on every chunk (vLLM `continuous_usage_stats`): the cached-token count is then
        # known before the first token, for Anthropic's message_start.
        upstream_body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    else:
        # A non-stream client gets a non-stream engine answer: one JSON body instead of a chunk
        # per sampled token (measured on the scripted engine: 1.5 ms vs 2.7 ms for 34 tokens).
        # The engine request is still closed when the client leaves (`collect_answer`).
        upstream_body.pop("stream_options", None)  # vLLM refuses stream_options without stream
    cap = record.Capture(
        episode_id=info.episode_id, attempt=info.attempt, api=route.api, model=norm.model, stream=norm.stream,
        request_key=record.request_key(info.episode_id, request.path, raw, request.headers.get("idempotency-key")),
        raw_request={"received_at": time.time(), "method": request.method, "path": request.path,
                     "query": record.scrub_query(request.args),
                     "headers": record.scrub_headers(request.headers), "body": body, "splice": spliced.report},
        normalized_request=upstream_body, policy_version_fallback=info.policy_version, engine_id=engine.id, t0=t0,
        stamp_from_updates=info.adapter is None)
    resp_id = module.response_id()
    if not norm.stream:
        relay.hold_while_reloading(engine, cap)
        result = relay.collect_answer(up, engine, upstream_body, info.episode_id, cap, norm,
                                      client_gone_probe(request.environ))
        body_out = module.render(result, norm, resp_id)
        try:
            record.write_completion(cap, result, body_out, resp_id, partial=False)
        except Exception:  # noqa: BLE001 - the harness retries; an unrecorded answer must not be used
            log.exception("could not record completion")
            raise GatewayError("internal", "The gateway could not record this completion; please retry") from None
        return json_response(body_out)
    writer = module.Stream(norm, resp_id)
    if weight_gate.is_reloading(engine.url):
        # The engine is loading new weights: answer 200 now, send keep-alives while held, then relay.
        return relay.sse_response(relay.guarded(relay.held_stream(
            writer, up, engine, upstream_body, info.episode_id, cap, resp_id, relay.history_call_ids(norm),
            relay.tool_call_limit(norm)),
            writer, module))
    # Wait briefly for the engine to accept: a rejection (context overflow...) is then a plain
    # HTTP error in the client's shape.  An engine that says nothing while it prefills gets a
    # 200 stream with keep-alives instead, and any later rejection arrives in-stream.
    opening = up.open_stream(engine, upstream_body, info.episode_id, gateway_settings().keepalive_s)
    outcome = opening.result
    if isinstance(outcome, GatewayError):
        if not module.ERRORS_IN_STREAM:
            raise outcome
        frames = writer.opening() + writer.fail(outcome, ChunkNormalizer().result)
        return relay.sse_response(iter(frames), passthrough=False)
    return relay.sse_response(relay.guarded(
        relay.stream_answer(writer, opening, cap, resp_id, taken=relay.history_call_ids(norm),
                            max_calls=relay.tool_call_limit(norm)), writer, module))


def _splice(info: SessionInfo, api: str, up, engine, body: dict) -> splice.Splice:
    """The request's prompt as token ids spliced from this session's sampled ids
    (`app.proxy.splice`), unless the run turned it off (`splice_history: false`)."""
    if not info.splice_history:
        return splice.Splice(report={"miss": "disabled"})
    try:
        return splice.splice(up, engine, info.episode_id, api, body, info.attempt)
    except Exception:  # noqa: BLE001 - a splice bug must not fail the call: render from text instead
        log.exception("splice failed; rendering the request from text")
        return splice.Splice(report={"miss": "internal_error"})
