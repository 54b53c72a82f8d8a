"""Gateway errors and their rendering in each client API's own error shape.

Every failure inside the gateway is raised as `GatewayError(kind, message)`; the
HTTP layer renders it for the caller's API, so a Claude Code session sees an
Anthropic error body, Codex an OpenAI one and Gemini CLI a Google one.

Shapes:
  anthropic: {"type":"error","error":{"type":T,"message":M}}
  openai:    {"error":{"message":M,"type":T,"param":P,"code":C}}
  gemini:    {"error":{"code":HTTP,"message":M,"status":S}}

Context overflow keeps each provider's own wording because harnesses match on
it to trigger compaction (https://code.claude.com/docs/en/llm-gateway-rollout,
openai/codex `context_length_exceeded`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# kind -> default HTTP status
_STATUS = {
    "invalid_request": 400,
    "context_length": 400,
    "authentication": 401,
    "permission": 403,
    "not_found": 404,
    "too_large": 413,
    "unsupported_media": 415,
    "rate_limit": 429,
    "upstream": 502,
    "overloaded": 503,
    "internal": 500,
}

_ANTHROPIC_TYPE = {
    "invalid_request": "invalid_request_error",
    "context_length": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "too_large": "request_too_large",
    "unsupported_media": "invalid_request_error",
    "rate_limit": "rate_limit_error",
    "upstream": "api_error",
    "overloaded": "overloaded_error",
    "internal": "api_error",
}

_OPENAI_TYPE = {
    "invalid_request": ("invalid_request_error", None),
    "context_length": ("invalid_request_error", "context_length_exceeded"),
    "authentication": ("invalid_request_error", "invalid_api_key"),
    "permission": ("invalid_request_error", "permission_denied"),
    "not_found": ("invalid_request_error", "not_found"),
    "too_large": ("invalid_request_error", "request_too_large"),
    "unsupported_media": ("invalid_request_error", "unsupported_content_encoding"),
    "rate_limit": ("rate_limit_error", "rate_limit_exceeded"),
    "upstream": ("server_error", "upstream_error"),
    "overloaded": ("server_error", "server_overloaded"),
    "internal": ("server_error", None),
}

_GEMINI_STATUS = {
    "invalid_request": "INVALID_ARGUMENT",
    "context_length": "INVALID_ARGUMENT",
    "authentication": "UNAUTHENTICATED",
    "permission": "PERMISSION_DENIED",
    "not_found": "NOT_FOUND",
    "too_large": "INVALID_ARGUMENT",
    "unsupported_media": "INVALID_ARGUMENT",
    "rate_limit": "RESOURCE_EXHAUSTED",
    "upstream": "INTERNAL",
    "overloaded": "UNAVAILABLE",
    "internal": "INTERNAL",
}


@dataclass
class GatewayError(Exception):
    """A failure to report to the client.

    kind: one of the keys of `_STATUS` (invalid_request, context_length, authentication,
    not_found, too_large, upstream, overloaded, ...). `prompt_tokens`/`max_tokens` are
    set for context_length so each API can phrase the overflow its own way.
    """

    kind: str
    message: str
    param: str | None = None
    prompt_tokens: int | None = None
    max_context: int | None = None
    status: int | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)
        if self.status is None:
            self.status = _STATUS.get(self.kind, 500)

    @property
    def retryable(self) -> bool:
        return self.kind in {"upstream", "overloaded", "rate_limit", "internal"}


def context_error(prompt_tokens: int | None, max_context: int | None) -> GatewayError:
    return GatewayError("context_length", "prompt is too long", prompt_tokens=prompt_tokens,
                        max_context=max_context)


def _context_message(api: str, err: GatewayError) -> str:
    n = err.prompt_tokens if err.prompt_tokens is not None else "?"
    m = err.max_context if err.max_context is not None else "?"
    if api == "anthropic":
        return f"prompt is too long: {n} tokens > {m} maximum"
    if api == "gemini":
        return f"The input token count ({n}) exceeds the maximum number of tokens allowed ({m})."
    return (f"This model's maximum context length is {m} tokens. However, your messages resulted in "
            f"{n} tokens. Please reduce the length of the messages.")


def error_body(api: str, err: GatewayError) -> dict:
    """The JSON error body for `api` (anthropic | chat | responses | gemini | openai)."""
    message = _context_message(api, err) if err.kind == "context_length" else err.message
    if api == "anthropic":
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPE.get(err.kind, "api_error"), "message": message}}
    if api == "gemini":
        return {"error": {"code": err.status, "message": message,
                          "status": _GEMINI_STATUS.get(err.kind, "INTERNAL")}}
    typ, code = _OPENAI_TYPE.get(err.kind, ("server_error", None))
    return {"error": {"message": message, "type": typ, "param": err.param, "code": code}}


def openai_error_object(err: GatewayError) -> dict:
    """`{"code","message"}` as carried by a Responses `response.failed` event."""
    _, code = _OPENAI_TYPE.get(err.kind, ("server_error", None))
    return {"code": code or "server_error", "message": _context_message("responses", err)
            if err.kind == "context_length" else err.message}


# vLLM's wordings (old and new) of a context overflow:
#   "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens
#    (8000 in the messages, 1000 in the completion). ..."
#   "... maximum context length is 8192 tokens and your request has 9000 input tokens ..."
_MAX_RE = re.compile(r"maximum context length is (\d+)")
_INPUT_RE = re.compile(r"(\d+) in the messages|has (\d+) input tokens|(\d+) input tokens|"
                       r"resulted in (\d+) tokens")


def parse_context_overflow(message: str) -> tuple[int | None, int | None] | None:
    """(prompt_tokens, max_context) when `message` is vLLM's context-length wording, else None."""
    m = _MAX_RE.search(message or "")
    if not m:
        return None
    n = _INPUT_RE.search(message)
    prompt = None
    if n:
        prompt = int(next(g for g in n.groups() if g is not None))
    return prompt, int(m.group(1))
