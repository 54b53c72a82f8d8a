"""The client APIs the gateway speaks: one declared interface, one registry.

Each API is one module (`anthropic`, `chat`, `responses`, `gemini`) with the same public
names and signatures, declared by `ApiModule` (a module satisfies a Protocol as an object
does) and checked for every registered module by the tests.  The router reads only this
interface, so a fifth API is one new module plus its line in `REGISTRY` (and the paths
`app.proxy.detect` routes to it).

The engine side is one internal Chat Completions request (`Normalized.chat`); an API module
translates its request into it (`normalize`), the engine's answer back (`render`, `Stream`),
errors into its own error shape (`error_body`), and reads its recorded answers back as the
engine's assistant message (`answer_of`, used by the splice and the dashboard).
"""
from __future__ import annotations

from typing import Protocol

from app.proxy import anthropic, chat, gemini, responses
from app.proxy.canonical import Result
from app.proxy.common import NO_CONTEXT, CallContext, Normalized
from app.proxy.errors import GatewayError


class StreamWriter(Protocol):
    """One streamed answer in an API's SSE format.  The relay calls `opening` once before the
    engine accepts, `keepalive` while it is silent, `start` and `on_event` per engine chunk, then
    `finish` (or `fail` after an error); each returns the SSE frames to send.  `done` is True
    once a terminal frame was produced; `final_body` is the non-stream body the stream equals
    (what is recorded)."""

    done: bool

    def __init__(self, norm: Normalized, resp_id: str) -> None: ...

    def opening(self) -> list[bytes]: ...

    def keepalive(self) -> bytes: ...

    def start(self, r: Result) -> list[bytes]: ...

    def on_event(self, ev: tuple, r: Result) -> list[bytes]: ...

    def finish(self, r: Result) -> list[bytes]: ...

    def fail(self, err: GatewayError, r: Result) -> list[bytes]: ...

    def final_body(self, r: Result) -> dict: ...


class ApiModule(Protocol):
    """What every API module defines (module-level names; `self` is the module).

    API: its name as recorded (`Completion.api`) and routed (`app.proxy.detect`).
    ERRORS_IN_STREAM: an engine refusal before the first token is answered as a 200 stream that
        ends in the API's failure event (Codex reads errors only from the stream), not as an
        HTTP error.
    Stream: the `StreamWriter` class of the API.
    """

    API: str
    ERRORS_IN_STREAM: bool
    Stream: type[StreamWriter]

    def response_id(self) -> str:
        """A fresh id for one answer, in the API's own form (`msg_…`, `chatcmpl-…`, …)."""

    def normalize(self, body: dict, ctx: CallContext = NO_CONTEXT) -> Normalized:
        """The request `body` as the engine's Chat request.  Raises GatewayError (400) on bad input."""

    def render(self, r: Result, norm: Normalized, resp_id: str) -> dict:
        """The non-stream answer body for the engine's answer `r`."""

    def error_body(self, err: GatewayError) -> dict:
        """`err` in the API's JSON error shape."""

    def models_body(self, model_ids: list[str]) -> dict:
        """The API's model list for `GET …/models`."""

    def model_body(self, model_id: str) -> dict:
        """One entry of `models_body`, for `GET …/models/{id}`."""

    def count_body(self, count: int) -> dict:
        """The token-counting answer for `count` prompt tokens.  Raises GatewayError (not_found)
        for an API without a counting endpoint."""

    def answer_of(self, response: dict | None) -> dict | None:
        """The assistant message (Chat form: role, content, tool_calls, reasoning) of a recorded
        answer body, read by the API's own history reader; None when it holds none."""


REGISTRY: dict[str, ApiModule] = {m.API: m for m in (anthropic, chat, responses, gemini)}
# A caller whose API is not known (a path no API serves) gets OpenAI's error shape, the most common.
FALLBACK: ApiModule = chat


def api_module(api: str) -> ApiModule:
    """The module of `api`; FALLBACK (Chat) for a name no module registers."""
    return REGISTRY.get(api, FALLBACK)
