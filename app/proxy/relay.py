"""The answer relay: the engine's answer to the client, recorded exactly once.

Non-stream answers (`collect_answer`) are read whole while the client is watched; the router
records them before returning.  Streamed answers (`stream_answer`) are relayed chunk by
chunk with keep-alives while the engine is silent, recorded before their terminal frames,
or in the generator's finally path when the client disconnects (partial=True), so a
completion is never lost and never written twice.  Requests that arrive during a weight
reload are held (`hold_while_reloading`, `held_stream`); a stream whose production breaks
after its 200 head still ends in its API's error shape (`guarded`).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterator

from flask import Response

from app import weight_gate
from app.proxy import record
from app.proxy.apis import ApiModule, StreamWriter
from app.proxy.canonical import ChunkNormalizer, Result, result_from_completion, withhold_calls
from app.proxy.common import Normalized
from app.proxy.errors import GatewayError
from app.proxy.settings import gateway_settings
from app.proxy.sse import frame
from app.proxy.upstream import DONE, EOF, PendingStream

log = logging.getLogger("turnstile.gateway")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def sse_response(frames: Iterator[bytes], passthrough: bool = True) -> Response:
    """A `text/event-stream` response relaying `frames` as they come (no buffering proxies)."""
    return Response(frames, mimetype="text/event-stream", headers=SSE_HEADERS, direct_passthrough=passthrough)


def guarded(frames: Iterator[bytes], writer: StreamWriter, module: ApiModule) -> Iterator[bytes]:
    """A stream whose production fails after the 200 head still ends in its API's own error
    shape (Anthropic `error` event, Chat error chunk + [DONE], Responses `response.failed`,
    Gemini error chunk), never as a cut chunked body."""
    try:
        yield from frames
    except Exception:  # noqa: BLE001 - a bug must still end the stream in the caller's shape
        log.exception("gateway error while streaming a %s answer", module.API)
        if writer.done:
            return
        err = GatewayError("internal", "Internal gateway error while streaming the answer")
        try:
            out = writer.fail(err, Result())
        except Exception:  # noqa: BLE001
            out = [frame(module.error_body(err))]
        yield b"".join(out)


class ClientGone(Exception):
    """The client closed its connection while its non-stream answer was being generated."""


def collect_answer(up, engine, body: dict, episode_id: int, cap: record.Capture, norm: Normalized,
                   gone: Callable[[], bool]) -> Result:
    """A non-stream answer, asked of the engine as a non-stream answer and read on this thread
    while watching the client (`gone()`: True once it left) every 0.25 s of engine silence: if
    the client leaves, the engine connection is closed (vLLM, the embedded and the scripted
    engine abort the request) and nothing is recorded, since no sampled token reached the gateway.

    Raises:
        GatewayError: the engine refused or failed (its own error), its answer is not a chat
            completion, or the client left (status 499, nobody reads it).
    """
    def idle() -> None:
        if gone():
            raise ClientGone()

    try:
        answer = up.complete(engine, body, episode_id, idle=idle, idle_s=0.25)
    except ClientGone:
        log.info("client left before its non-stream answer was ready; engine request closed")
        raise GatewayError("invalid_request", "client disconnected", status=499) from None
    cap.accepted(None)  # the engine's answer head came with the whole answer: no queue time
    if isinstance(answer.get("error"), dict) or answer.get("object") == "error":
        err = answer["error"] if isinstance(answer.get("error"), dict) else answer
        raise GatewayError("upstream", f"The engine reported an error: {err.get('message')}")
    choices = answer.get("choices")
    if not (isinstance(choices, list) and choices and all(isinstance(c, dict) for c in choices)):
        raise GatewayError("upstream", "The engine's answer holds no choices the gateway could read")
    try:
        result = result_from_completion(answer, history_call_ids(norm), tool_call_limit(norm))
    except Exception:  # noqa: BLE001 - an answer that breaks the reader is the engine's fault
        log.exception("unreadable engine answer")
        raise GatewayError("upstream", "The engine sent an answer the gateway could not read") from None
    if result.finish_reason == "abort":  # kept as sampled (partial), answered as a retryable 503
        record.write_completion(cap, result, None, None, partial=True, error=ABORTED_MESSAGE)
        raise GatewayError("overloaded", ABORTED_MESSAGE)
    return result


# An engine answer ended by a weight update in mode `abort` (vLLM's and the embedded engine's
# finish_reason "abort"): the client gets a 503 overloaded error in its API's shape, which the
# openai and anthropic SDKs retry by themselves (their default max_retries is 2), and a stream
# an overloaded error event; its sampled tokens are recorded as a partial completion.
ABORTED_MESSAGE = ("The engine ended this answer to load new weights (weight update mode abort); send the "
                   "request again")


def hold_while_reloading(engine, cap: record.Capture) -> None:
    """Non-stream: wait (bounded) for the engine's weight reload to finish before sending."""
    if not weight_gate.is_reloading(engine.url):
        return
    with weight_gate.holding(engine.url) as hold:
        weight_gate.wait_open(engine.url, weight_gate.GATE_TTL_S)
    cap.raw_request["reload_held_ms"] = round(hold.seconds * 1000, 1)


def held_stream(writer: StreamWriter, up, engine, body: dict, episode_id: int, cap: record.Capture, resp_id: str,
                taken: set[str] | frozenset = frozenset(), max_calls: int | None = None) -> Iterator[bytes]:
    """Stream whose request arrived during a weight reload: opening frames and keep-alives
    while the gate is closed, then the normal relay (errors after this point go in-stream)."""
    keepalive = gateway_settings().keepalive_s
    yield from writer.opening()
    with weight_gate.holding(engine.url) as hold:  # counted as held even if the client leaves mid-hold
        while not weight_gate.wait_open(engine.url, keepalive):
            yield writer.keepalive()
    cap.raw_request["reload_held_ms"] = round(hold.seconds * 1000, 1)
    opening = up.open_stream(engine, body, episode_id, keepalive)
    yield from stream_answer(writer, opening, cap, resp_id, opened=True, taken=taken, max_calls=max_calls)


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


class Pacer:
    """Reads of one engine stream, at most one per `interval` seconds while tokens come faster.

    Tokens that come faster than the gateway's stream interval go out together: once a read
    comes sooner than `interval` after the last one, the relay sleeps off the rest of the
    interval before each read, and takes everything received meanwhile in one read and one
    write.  So at 2,000 tokens/s and 2 ms a stream costs one wake-up, one read and one write per
    4 tokens instead of per token (the same trade as vLLM's `--stream-interval`, counted here in
    time, so a token or the answer's end is relayed at most one interval late).  A stream slower
    than the interval is never delayed: its reads come after the interval anyway; once a paced
    read finds nothing waiting, reads wait for the engine again.
    """

    def __init__(self, handle, interval: float) -> None:
        self.handle, self.interval = handle, interval
        self.last = float("-inf")  # time.monotonic() of the last read handed out
        self.paced = False         # tokens came faster than the interval at the last read

    def read(self, timeout: float) -> list | None:
        """Upstream items (as `StreamHandle.poll`), or None after `timeout` s of engine silence."""
        if not self.interval:
            return self.handle.poll(timeout)
        items = None
        if self.paced:
            self._sleep_until(self.last + self.interval)
            items = self.handle.poll(0)  # what came meanwhile; None: the stream slowed down
            self.paced = items is not None
        if items is None:
            items = self.handle.poll(timeout)
            if items is None:
                return None
            if time.monotonic() < self.last + self.interval and isinstance(items[-1], dict):  # a chunk, not the end
                self._sleep_until(self.last + self.interval)
                items += self.handle.poll(0) or []
                self.paced = True
        self.last = time.monotonic()
        return items

    @staticmethod
    def _sleep_until(t: float) -> None:
        wait = t - time.monotonic()
        if wait > 0:
            time.sleep(wait)


def history_call_ids(norm: Normalized) -> set[str]:
    """The tool-call ids already used in this conversation (as the engine knows them)."""
    return {tc.get("id") for m in norm.chat.get("messages") or [] for tc in m.get("tool_calls") or []}


def tool_call_limit(norm: Normalized) -> int | None:
    """1 when the client asked for one tool call at a time (Chat and Responses
    `parallel_tool_calls: false`, Anthropic `tool_choice.disable_parallel_tool_use: true`, all
    normalized to the engine request's `parallel_tool_calls`), else None (`canonical.withhold_calls`)."""
    return 1 if norm.chat.get("parallel_tool_calls") is False else None


def stream_answer(writer: StreamWriter, opening: PendingStream, cap: record.Capture, resp_id: str,
                  opened: bool = False, taken: set[str] | frozenset = frozenset(),
                  max_calls: int | None = None) -> Iterator[bytes]:
    """Engine stream -> client SSE frames, with keep-alives while the engine is silent; at most
    `max_calls` tool calls are shown (`canonical.withhold_calls`; None: all).

    The completion is recorded before the terminal frames are sent; if the client goes
    away first (GeneratorExit at a yield), the finally path records what was sampled
    so far with partial=True and closes the upstream stream so the engine aborts.
    """
    norm = ChunkNormalizer(taken, max_calls)
    r = norm.result
    settings = gateway_settings()
    keepalive = settings.keepalive_s
    try:
        if not opened:  # held_stream already sent the opening frames
            yield from writer.opening()
        error: GatewayError | None = None
        while (handle := opening.wait(keepalive)) is None:
            yield writer.keepalive()
        cap.accepted(opening.t_done)
        if isinstance(handle, GatewayError):
            error, handle = handle, None
        finished = handle is None
        pace = Pacer(handle, settings.stream_interval_ms / 1000)
        while not finished:
            items = pace.read(keepalive)  # everything received so far, relayed in one write
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
        if error is None and r.finish_reason == "abort":
            error = GatewayError("overloaded", ABORTED_MESSAGE)
        if error is None:
            frames = []
            for ev in norm.finish():
                frames += writer.on_event(ev, r)
            frames += writer.finish(r)
        else:
            withhold_calls(r, max_calls)  # (`norm.finish` does it on success) the record shows what was shown
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
            withhold_calls(r, max_calls)
            try:
                record.write_completion(cap, r, writer.final_body(r), resp_id, partial=True,
                                        error="client disconnected before the answer was complete")
            except Exception:  # noqa: BLE001
                log.exception("could not record partial completion")
