"""Validation of engine request bodies, with errors in vLLM's shape.

Every helper raises ``EngineError`` (HTTP 400 unless stated), which the server renders as
``{"error": {"message", "type", "param", "code"}}`` (vLLM's ErrorResponse).  The context-limit
messages use vLLM's wording so harnesses that detect context overflow by text recognise them.
"""
from __future__ import annotations

import math
from typing import Any

from flask import request

from app.engines.embedded.sampling import SamplingParams


class EngineError(Exception):
    """A request error with an HTTP status; rendered in vLLM's error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param

    def body(self) -> dict:
        kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}.get(
            self.status, "InternalServerError")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.status}}


def get_field(body: dict, name: str, kind: type | tuple, default: Any = None) -> Any:
    """``body[name]`` checked against ``kind`` (ints accepted for floats, bools never for numbers);
    ``default`` when absent or null."""
    value = body.get(name, default)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise EngineError(f"'{name}' must be of type {names}", param=name)
    return value


def weights_name(body: dict, default: str) -> str:
    """A load request's ``weights``: the caller's name for the weights it loads (at most 4096
    characters), which ``GET /v1/policy_version`` reports back; ``default`` when absent."""
    name = get_field(body, "weights", str, default)
    if not name or len(name) > 4096:
        raise EngineError("'weights' must be a non-empty string of at most 4096 characters", param="weights")
    return name


def update_mode_fields(body: dict) -> dict:
    """A load request's weight update mode: ``{"mode": "keep"|"wait"|"abort"|None, "recompute_kv":
    bool|None}`` (None: the engine's default), the keywords of ``BatchScheduler.reload``.
    Raises EngineError (400, ``param`` the field) for an unknown mode or a non-boolean flag."""
    from app.runconfig import WEIGHT_UPDATE_MODES

    mode = get_field(body, "mode", str)
    if mode is not None and mode not in WEIGHT_UPDATE_MODES:
        raise EngineError(f"unknown weight update mode {mode!r}; choose one of {', '.join(WEIGHT_UPDATE_MODES)}",
                          param="mode")
    return {"mode": mode, "recompute_kv": get_field(body, "recompute_kv", bool)}


def json_body() -> dict:
    """The current Flask request's JSON object (400 when missing or not an object)."""
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise EngineError("request body must be a JSON object")
    return body


def sampling_params(body: dict) -> SamplingParams:
    """``temperature`` (≥ 0), ``top_p`` (0, 1], ``top_k``, ``seed``, ``top_logprobs`` (0–20, only with ``logprobs``)."""
    temperature = get_field(body, "temperature", float, 1.0)
    top_p = get_field(body, "top_p", float, 1.0)
    top_k = get_field(body, "top_k", int, 0)
    seed = get_field(body, "seed", int)
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if not math.isfinite(value):  # JSON parsers accept NaN/Infinity; comparisons with NaN are all False
            raise EngineError(f"'{name}' must be a finite number", param=name)
    if temperature < 0:
        raise EngineError("'temperature' must be >= 0", param="temperature")
    if not 0 < top_p <= 1:
        raise EngineError("'top_p' must be in (0, 1]", param="top_p")
    logprobs = get_field(body, "logprobs", bool, False)
    top_logprobs = get_field(body, "top_logprobs", int, 0)
    if not 0 <= top_logprobs <= 20:
        raise EngineError("'top_logprobs' must be between 0 and 20", param="top_logprobs")
    return SamplingParams(temperature, top_p, top_k, seed, top_logprobs if logprobs else 0)


def stop_strings(body: dict) -> list[str]:
    """``stop`` as a list of non-empty strings (a string or a list of strings is accepted)."""
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise EngineError("'stop' must be a string or a list of strings", param="stop")


def resolve_max_tokens(body: dict, prompt_len: int, limit: int) -> int:
    """Resolve ``max_completion_tokens``/``max_tokens`` against the context limit (vLLM's messages)."""
    requested = get_field(body, "max_completion_tokens", int)
    if requested is None:
        requested = get_field(body, "max_tokens", int)
    if requested is not None and requested < 1:
        raise EngineError("'max_tokens' must be at least 1", param="max_tokens")
    if prompt_len >= limit:
        raise EngineError(f"This model's maximum context length is {limit} tokens. However, your request has "
                          f"{prompt_len} input tokens. Please reduce the length of the input messages.",
                          param="messages")
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise EngineError(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the "
                          f"completion). Please reduce the length of the messages or completion.",
                          param="max_tokens")
    return requested
