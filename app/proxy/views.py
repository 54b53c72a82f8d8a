"""HTTP layer of the gateway: route, authenticate, normalize, call the engine, answer, record.

One catch-all route serves every API under any base-URL prefix; `detect` picks
the API.  Non-stream answers are recorded before they are returned; streamed
answers are recorded before their terminal event, or in the generator's finally
path when the client disconnects (partial=True), so a completion is never lost
and never written twice.
"""
from __future__ import annotations

import json
import logging
import re
import time
import zlib
from typing import Iterator

from flask import Flask, Response, request
from werkzeug.exceptions import RequestEntityTooLarge

from app import weight_gate
from app.engines.disconnect import client_gone_probe
from app.proxy import anthropic, chat, gemini, record, responses, splice
from app.proxy.canonical import ChunkNormalizer, Result, new_id, result_from_completion
from app.proxy.common import Normalized, gateway_settings
from app.proxy.detect import Route, api_from_headers, detect
from app.proxy.errors import GatewayError, error_body
from app.proxy.sessions import SessionInfo, resolve_session_info
from app.proxy.sse import dumps, frame
from app.proxy.upstream import DONE, EOF, PendingStream, get_upstream

log = logging.getLogger("turnstile.gateway")
MODULES = {"anthropic": anthropic, "chat": chat, "responses": responses, "gemini": gemini}
ID_PREFIX = {"anthropic": "msg_", "chat": "chatcmpl-", "responses": "resp_", "gemini": ""}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def json_response(body: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(dumps(body), status=status, mimetype="application/json", headers=headers)


def error_response(api: str, err: GatewayError) -> Response:
    headers = {"x-should-retry": "true" if err.retryable else "false"}
    return json_response(error_body(api if api in MODULES else "chat", err), err.status or 500, headers)


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


def decode_body(raw: bytes, encoding: str, limit: int) -> bytes:
    """The request body with its Content-Encoding removed (RFC 9110 §8.4: codings listed in
    the order applied).  gzip, deflate and zstd (RFC 8878; Codex compresses with it) are
    accepted; an unknown coding is a 415 (RFC 9110 §15.5.16); the decoded body may not
    exceed `limit` bytes, so a small compression bomb cannot exhaust memory."""
    codings = [c.strip().lower() for c in encoding.split(",") if c.strip()]
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
            import zstandard
            try:
                with zstandard.ZstdDecompressor().stream_reader(raw) as reader:
                    out = reader.read(limit + 1)
                    while len(out) <= limit:
                        more = reader.read(limit + 1 - len(out))
                        if not more:
                            break
                        out += more
            except zstandard.ZstdError as exc:
                raise GatewayError("invalid_request", f"Request body is not valid zstd data: {exc}") from None
        else:
            raise GatewayError("unsupported_media", f"Unsupported Content-Encoding {coding!r}; "
                                                    f"use gzip, deflate, zstd or identity")
        if len(out) > limit:
            raise GatewayError("too_large", f"Request body exceeds {limit} bytes once decompressed")
        raw = out
    return raw


_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def _replace_surrogates(value):
    """Strings with lone UTF-16 surrogates (a JSON escape like "\\ud83d" without its pair)
    cannot be encoded as UTF-8; each is replaced by U+FFFD, as a UTF-8 decoder would
    (RFC 8259 §8.2 leaves such strings' behaviour unpredictable).  U+0000 is replaced the same
    way: PostgreSQL text and JSONB cannot hold it (https://www.postgresql.org/docs/current/datatype-json.html),
    and the engine must see exactly what is recorded."""
    if isinstance(value, str):
        return _UNSTORABLE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_replace_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_replace_surrogates(k): _replace_surrogates(v) for k, v in value.items()}
    return value


def parse_body(raw: bytes) -> dict:
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
    if b"\\u" in raw and (b"\\u0000" in raw or re.search(rb"\\u[dD][89abcdefABCDEF]", raw)):
        body = _replace_surrogates(body)
    return body


def _no_constant(name: str):
    """`NaN`, `Infinity`, `-Infinity` are not JSON (RFC 8259 §6), though Python's parser accepts them;
    they must not reach the engine nor the record (SQLite's and PostgreSQL's JSON reject them)."""
    raise ValueError(f"{name} is not a JSON number (RFC 8259 section 6)")


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
        limit = gateway_settings().max_body_bytes
        try:
            raw = request.get_data(cache=False)
        except RequestEntityTooLarge:
            raise GatewayError("too_large", f"Request body exceeds {limit} bytes")
        if request.headers.get("content-encoding"):
            raw = decode_body(raw, request.headers["content-encoding"], limit)
        body = parse_body(raw)
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
        return json_response(MODULES[route.api].models_body(model_ids()))
    if route.op == "model":
        return json_response(gemini.models_body([route.model or "default"])["models"][0])
    if route.op == "retrieve":
        info = authenticate()
        found = record.find_response(info.episode_id, route.resource or "")
        if found is None:
            raise GatewayError("not_found", f"Response with id '{route.resource}' not found.")
        return json_response(found[1])
    raise GatewayError("not_found", "No such endpoint")


def count_tokens(route: Route, body: dict, info: SessionInfo) -> Response:
    if route.api == "anthropic":
        norm = anthropic.normalize({**body, "max_tokens": 1}, count_only=True)
    else:
        req = body.get("generateContentRequest") if isinstance(body.get("generateContentRequest"), dict) else body
        norm = gemini.normalize(req, route.model or "default", False)
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
    return json_response({"input_tokens": count} if route.api == "anthropic" else {"totalTokens": count})


def _normalize(route: Route, body: dict, info: SessionInfo) -> Normalized:
    if route.api == "anthropic":
        return anthropic.normalize(body)
    if route.api == "chat":
        return chat.normalize(body)
    if route.api == "gemini":
        return gemini.normalize(body, gemini.model_from_path(route.model or "default"), route.stream)
    history = None
    prev = body.get("previous_response_id")
    if prev is not None:
        if not isinstance(prev, str):
            raise GatewayError("invalid_request", "previous_response_id: expected a string",
                               param="previous_response_id")
        try:
            history = record.response_history(info.episode_id, prev)
        except LookupError:
            raise GatewayError("invalid_request", f"Previous response with id '{prev}' not found.",
                               param="previous_response_id") from None
    return responses.normalize(body, history)


def _has_control(text: str) -> bool:
    """True when `text` holds an ASCII control character (U+0000-U+001F, U+007F): never part of a
    model API's path or query, and U+0000 cannot be recorded (PostgreSQL text)."""
    return any(ch < " " or ch == "\x7f" for ch in text)


MODEL_MAX_CHARS = 255  # the recorded model name's column (`Completion.model`)


def generate(route: Route, body: dict, raw: bytes, info: SessionInfo, t0: float) -> Response:
    norm = _normalize(route, body, info)
    if len(norm.model or "") > MODEL_MAX_CHARS:  # checked before the engine is asked, never at record time
        raise GatewayError("invalid_request", f"model: at most {MODEL_MAX_CHARS} characters", param="model")
    up = get_upstream()
    engine = up.describe(up.pick(info.episode_id))
    upstream_body = dict(norm.chat, model=engine.model, stream=norm.stream, return_token_ids=True, logprobs=True)
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
        normalized_request=upstream_body, policy_version_fallback=info.policy_version, engine_id=engine.id, t0=t0)
    resp_id = ID_PREFIX[route.api] + new_id("", 12) if route.api != "gemini" else new_id("", 10)
    module = MODULES[route.api]
    if not norm.stream:
        _hold_while_reloading(engine, cap)
        result = collect_answer(up, engine, upstream_body, info.episode_id, cap, norm)
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
        return Response(guarded(held_stream(writer, up, engine, upstream_body, info.episode_id, cap, resp_id,
                                            history_call_ids(norm)), writer, route.api),
                        mimetype="text/event-stream", headers=SSE_HEADERS, direct_passthrough=True)
    # Wait briefly for the engine to accept: a rejection (context overflow...) is then a plain
    # HTTP error in the client's shape.  An engine that says nothing while it prefills gets a
    # 200 stream with keep-alives instead, and any later rejection arrives in-stream.
    opening = up.open_stream(engine, upstream_body, info.episode_id, gateway_settings().keepalive_s)
    outcome = opening.result
    if isinstance(outcome, GatewayError):
        if route.api != "responses":
            raise outcome
        # Codex reads errors from the stream: response.created, then response.failed.
        frames = writer.opening() + writer.fail(outcome, ChunkNormalizer().result)
        return Response(iter(frames), mimetype="text/event-stream", headers=SSE_HEADERS)
    return Response(guarded(stream_answer(writer, opening, cap, resp_id, taken=history_call_ids(norm)),
                            writer, route.api),
                    mimetype="text/event-stream", headers=SSE_HEADERS, direct_passthrough=True)


def guarded(frames: Iterator[bytes], writer, api: str) -> Iterator[bytes]:
    """A stream whose production fails after the 200 head still ends in its API's own error
    shape (Anthropic `error` event, Chat error chunk + [DONE], Responses `response.failed`,
    Gemini error chunk), never as a cut chunked body."""
    try:
        yield from frames
    except Exception:  # noqa: BLE001 - a bug must still end the stream in the caller's shape
        log.exception("gateway error while streaming a %s answer", api)
        if writer.done:
            return
        err = GatewayError("internal", "Internal gateway error while streaming the answer")
        try:
            out = writer.fail(err, Result())
        except Exception:  # noqa: BLE001
            out = [frame(error_body(api, err))]
        yield b"".join(out)


class ClientGone(Exception):
    """The client closed its connection while its non-stream answer was being generated."""


def collect_answer(up, engine, body: dict, episode_id: int, cap: record.Capture, norm: Normalized) -> Result:
    """A non-stream answer, asked of the engine as a non-stream answer and read on this thread
    while watching the client every 0.25 s of engine silence: if the client leaves, the engine
    connection is closed (vLLM, the embedded and the scripted engine abort the request) and
    nothing is recorded, since no sampled token reached the gateway.

    Raises:
        GatewayError: the engine refused or failed (its own error), its answer is not a chat
            completion, or the client left (status 499, nobody reads it).
    """
    gone = client_gone_probe(request.environ)

    def idle() -> None:
        if gone():
            raise ClientGone()

    try:
        answer = up.complete(engine, body, episode_id, idle=idle, idle_s=0.25)
    except ClientGone:
        log.info("client left before its non-stream answer was ready; engine request closed")
        raise GatewayError("invalid_request", "client disconnected", status=499) from None
    _accepted(cap, None)  # the engine's answer head came with the whole answer: no queue time
    if isinstance(answer.get("error"), dict) or answer.get("object") == "error":
        err = answer["error"] if isinstance(answer.get("error"), dict) else answer
        raise GatewayError("upstream", f"The engine reported an error: {err.get('message')}")
    choices = answer.get("choices")
    if not (isinstance(choices, list) and choices and all(isinstance(c, dict) for c in choices)):
        raise GatewayError("upstream", "The engine's answer holds no choices the gateway could read")
    try:
        return result_from_completion(answer, history_call_ids(norm))
    except Exception:  # noqa: BLE001 - an answer that breaks the reader is the engine's fault
        log.exception("unreadable engine answer")
        raise GatewayError("upstream", "The engine sent an answer the gateway could not read") from None


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


def _accepted(cap: record.Capture, t_accepted: float | None) -> None:
    """The engine accepted the request (at `t_accepted`, perf_counter): stamp the time; the request
    body was sent, so the spliced prompt ids leave the record (the engine's own prompt ids are
    recorded instead)."""
    cap.t_accepted = t_accepted
    cap.normalized_request.pop("prompt_token_ids", None)
    cap.normalized_request.pop("kv_transfer_params", None)


def _hold_while_reloading(engine, cap: record.Capture) -> None:
    """Non-stream: wait (bounded) for the engine's weight reload to finish before sending."""
    if not weight_gate.is_reloading(engine.url):
        return
    t0 = time.perf_counter()
    weight_gate.wait_open(engine.url, weight_gate.GATE_TTL_S)
    held = time.perf_counter() - t0
    cap.raw_request["reload_held_ms"] = round(held * 1000, 1)
    weight_gate.record_hold(engine.url, held)


def held_stream(writer, up, engine, body: dict, episode_id: int, cap: record.Capture, resp_id: str,
                taken: set[str] | frozenset = frozenset()) -> Iterator[bytes]:
    """Stream whose request arrived during a weight reload: opening frames and keep-alives
    while the gate is closed, then the normal relay (errors after this point go in-stream)."""
    t0 = time.perf_counter()
    keepalive = gateway_settings().keepalive_s
    yield from writer.opening()
    while not weight_gate.wait_open(engine.url, keepalive):
        yield writer.keepalive()
    held = time.perf_counter() - t0
    cap.raw_request["reload_held_ms"] = round(held * 1000, 1)
    weight_gate.record_hold(engine.url, held)
    opening = up.open_stream(engine, body, episode_id, keepalive)
    yield from stream_answer(writer, opening, cap, resp_id, opened=True, taken=taken)


def _upstream_item(item, r, error: GatewayError | None) -> tuple[GatewayError | None, bool]:
    """(error, finished) for one item from the upstream reader; finished=False means a chunk."""
    if item is DONE:
        return error, True
    if item is EOF:
        if r.finish_reason is None:
            return GatewayError("upstream", "The engine closed the stream before it finished"), True
        return error, True
    if isinstance(item, Exception):
        return GatewayError("upstream", f"The engine stream failed: {item}"), True
    if isinstance(item.get("error"), dict) or item.get("object") == "error":
        err = item.get("error") if isinstance(item.get("error"), dict) else item
        return GatewayError("upstream", f"The engine reported an error: {err.get('message')}"), True
    return error, False


def _consume(item, r, error: GatewayError | None, feed, cap: record.Capture):
    """(error, finished, what `feed` returned) for one upstream item.

    A chunk goes to `feed` (the answer reader); a chunk that breaks it is the engine's fault
    and ends the answer with an upstream error.  The first sampled token stamps `cap.t_first`.
    """
    error, finished = _upstream_item(item, r, error)
    if finished:
        return error, True, None
    try:
        fed = feed(item)
    except Exception:  # noqa: BLE001 - a chunk that breaks the reader is the engine's fault
        log.exception("unreadable engine chunk")
        return GatewayError("upstream", "The engine sent a chunk the gateway could not read"), True, None
    if cap.t_first is None and r.sampled_ids:
        cap.t_first = time.perf_counter()
    return error, False, fed


def history_call_ids(norm: Normalized) -> set[str]:
    """The tool-call ids already used in this conversation (as the engine knows them)."""
    return {tc.get("id") for m in norm.chat.get("messages") or [] for tc in m.get("tool_calls") or []}


def stream_answer(writer, opening: PendingStream, cap: record.Capture, resp_id: str,
                  opened: bool = False, taken: set[str] | frozenset = frozenset()) -> Iterator[bytes]:
    """Engine stream -> client SSE frames, with keep-alives while the engine is silent.

    The completion is recorded before the terminal frames are sent; if the client goes
    away first (GeneratorExit at a yield), the finally path records what was sampled
    so far with partial=True and closes the upstream stream so the engine aborts.
    """
    norm = ChunkNormalizer(taken)
    r = norm.result
    keepalive = gateway_settings().keepalive_s
    try:
        if not opened:  # held_stream already sent the opening frames
            yield from writer.opening()
        error: GatewayError | None = None
        while (handle := opening.wait(keepalive)) is None:
            yield writer.keepalive()
        _accepted(cap, opening.t_done)
        if isinstance(handle, GatewayError):
            error, handle = handle, None
        finished = handle is None
        while not finished:
            items = handle.poll(keepalive)  # everything received so far, relayed in one write
            if items is None:
                yield writer.keepalive()
                continue
            frames = []
            for item in items:
                error, finished, events = _consume(item, r, error, norm.feed, cap)
                if finished:
                    break
                frames += writer.start(r)
                for ev in events:
                    frames += writer.on_event(ev, r)
            if frames:
                yield b"".join(frames)
        if error is None:
            frames = []
            for ev in norm.finish():
                frames += writer.on_event(ev, r)
            frames += writer.finish(r)
        else:
            frames = writer.fail(error, r)
        if not norm.first_chunk_seen:
            cap.written = True  # the engine never started this answer: nothing to record
        try:
            record.write_completion(cap, r, writer.final_body(r), resp_id, partial=error is not None,
                                    error=error.message if error else None)
        except Exception:  # noqa: BLE001 - the answer is already on the wire; keep the stream well-formed
            log.exception("could not record streamed completion")
        yield b"".join(frames)
    finally:
        opening.cancel()
        if not cap.written and norm.first_chunk_seen:
            try:
                record.write_completion(cap, r, writer.final_body(r), resp_id, partial=True,
                                        error="client disconnected before the answer was complete")
            except Exception:  # noqa: BLE001
                log.exception("could not record partial completion")
