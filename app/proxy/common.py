"""Shared pieces of request normalization: the internal request, message repair, reasoning signatures.

Every client API is normalized to one internal OpenAI Chat Completions request
(`Normalized.chat`); API-specific facts needed to answer (requested model name,
custom-tool names, usage wishes...) travel in `Normalized.meta`.
"""
from __future__ import annotations

import base64
import json
import logging
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

from app.proxy import limits
from app.proxy.canonical import engine_call_id
from app.proxy.errors import GatewayError
from app.proxy.settings import gateway_settings

log = logging.getLogger("turnstile.gateway")


@dataclass
class Normalized:
    """One client request in internal form.

    api: anthropic | chat | responses | gemini; chat: Chat Completions body for the engine
    (without the gateway's recording fields); model: the client's model string (echoed back);
    meta: API-specific answer hints.
    """

    api: str
    chat: dict
    model: str
    stream: bool
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CallContext:
    """What an API module's `normalize` may read besides the request body.

    model: the model named in the URL path (Gemini's `/models/{model}:generateContent`; the
    other APIs name it in the body); stream: whether the path asks for a stream (Gemini's
    `:streamGenerateContent`); count_only: the body is to be counted, not answered (no
    sampling fields are read); history: looks up the input items a Responses
    `previous_response_id` stands for (raises LookupError for an unknown id), None when no
    session is known.
    """

    model: str = "default"
    stream: bool = False
    count_only: bool = False
    history: Callable[[str], list] | None = None


NO_CONTEXT = CallContext()


def answer_turn(read: Callable[[], list[dict]]) -> dict | None:
    """The one assistant message that `read()` (an API's history reader applied to a recorded
    answer) yields; None when it yields none, several, or refuses the answer (GatewayError)."""
    try:
        out = read()
    except GatewayError:
        return None
    turns = [m for m in out if m.get("role") == "assistant"]
    return turns[0] if len(turns) == 1 else None


def openai_models_body(model_ids: list[str], created: int) -> dict:
    """OpenAI's `GET /v1/models` list (https://platform.openai.com/docs/api-reference/models/list)."""
    return {"object": "list", "data": [{"id": m, "object": "model", "created": created, "owned_by": "turnstile"}
                                       for m in model_ids]}


# --- type checks that raise the caller-facing 400 -----------------------------------


def expect(cond: bool, message: str, param: str | None = None) -> None:
    if not cond:
        raise GatewayError("invalid_request", message, param=param)


def expect_type(value: Any, types: type | tuple, name: str, *, optional: bool = True) -> Any:
    if value is None and optional:
        return None
    if isinstance(value, bool) and types in (int, float, (int, float)):
        raise GatewayError("invalid_request", f"{name}: expected a number, got a boolean", param=name)
    if not isinstance(value, types):
        tname = types.__name__ if isinstance(types, type) else "/".join(t.__name__ for t in types)
        raise GatewayError("invalid_request",
                           f"{name}: expected {tname}, got {type(value).__name__}", param=name)
    return value


def positive_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    expect_type(value, int, name)
    expect(value >= 1, f"{name}: must be >= 1, got {value}", name)
    return value


# Ranges every engine accepts (OpenAI and vLLM sampling parameters); a value outside them is
# the caller's error, answered before anything is generated.
SAMPLING_RANGES = {"temperature": (0.0, None), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0), "top_k": (-1, None),
                   "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0),
                   "repetition_penalty": (0.0, None)}


def copy_sampling(src: dict, dst: dict, mapping: dict[str, str]) -> None:
    """Copy numeric sampling fields `src[k]` -> `dst[v]` after type and range checks.

    Python's JSON parser accepts `NaN` and `Infinity`: a non-finite value, or one outside the
    range engines accept (`SAMPLING_RANGES`, by the engine-side name), is a 400 naming the
    field.  Checked here, so one session's bad value never reaches a batch it shares with others.
    """
    for k, v in mapping.items():
        if src.get(k) is not None:
            expect_type(src[k], (int, float), k)
            value = src[k]
            expect(math.isfinite(value), f"{k}: must be a finite number, got {value!r}", k)
            low, high = SAMPLING_RANGES.get(v, (None, None))
            expect((low is None or value >= low) and (high is None or value <= high),
                   f"{k}: must be {'>= ' + str(low) if high is None else f'between {low} and {high}'}, got {value!r}", k)
            dst[v] = value


def limit_tokens(*candidates: int | None) -> int:
    """Exactly one completion limit for the engine: the smallest given, else the default."""
    given = [c for c in candidates if c is not None]
    return min(given) if given else gateway_settings().default_max_tokens


def stop_list(value: Any, name: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    expect(isinstance(value, list) and all(isinstance(s, str) for s in value),
           f"{name}: expected a string or a list of strings", name)
    return list(value) or None


# --- content --------------------------------------------------------------------------


def image_part(url: str, media_type: str = "image", size_hint: int | None = None) -> dict:
    """An image as a Chat content part, or a visible text placeholder for text-only engines."""
    if gateway_settings().vision:
        return {"type": "image_url", "image_url": {"url": url}}
    size = f", {size_hint} bytes" if size_hint else ""
    log.warning("image replaced by a placeholder (engine is text-only; TURNSTILE_GATEWAY_VISION=0)")
    return {"type": "text", "text": f"[image omitted: {media_type}{size}; this model cannot see images]"}


def data_url(media_type: str, data: str) -> str:
    return f"data:{media_type};base64,{data}"


def simplify_content(parts: list[dict]) -> str | list[dict]:
    """Parts -> a plain string when all are text (templates handle strings best)."""
    if all(p.get("type") == "text" for p in parts):
        return "\n".join(p["text"] for p in parts if p.get("text"))
    return parts


def text_of(parts: list[dict]) -> str:
    return "\n".join(p.get("text", "") for p in parts if p.get("type") == "text" and p.get("text"))


def tool_result_messages(call_id: str, parts: list[dict], name: str | None = None) -> list[dict]:
    """A tool result as Chat messages: the tool message (text), then a user message holding
    any images, because Chat tool messages cannot carry images."""
    texts = [p for p in parts if p.get("type") == "text"]
    images = [p for p in parts if p.get("type") == "image_url"]
    tool = {"role": "tool", "tool_call_id": call_id, "content": text_of(texts)}
    if name:
        tool["name"] = name
    out = [tool]
    if images:
        out.append({"role": "user", "content": [{"type": "text", "text": f"Images returned by tool call {call_id}:"},
                                                *images]})
    return out


def finalize_messages(messages: list[dict]) -> list[dict]:
    """Repair a converted conversation so every chat template accepts it.

    * all system-level text (system/developer anywhere) -> one leading system message;
    * consecutive assistant messages merged (text + tool calls), so a tool result always
      follows the assistant message carrying its call;
    * a tool result whose call is unknown becomes user text instead of a template error;
    * assistant messages with tool calls and no text get content None;
    * tool-call ids the gateway made unique go back to the engine's own ids.
    """
    system_texts: list[str] = []
    out: list[dict] = []
    known_calls: set[str] = set()
    for msg in messages:
        role = msg.get("role")
        if role in ("system", "developer"):
            content = msg.get("content")
            text = content if isinstance(content, str) else text_of(content or [])
            if text:
                system_texts.append(text)
            continue
        if role == "assistant":
            if msg.get("tool_calls"):
                msg = dict(msg, tool_calls=[dict(tc, id=engine_call_id(tc["id"])) for tc in msg["tool_calls"]])
            for tc in msg.get("tool_calls") or []:
                known_calls.add(tc["id"])
            if out and out[-1].get("role") == "assistant":
                _merge_assistant(out[-1], msg)
                continue
            out.append(dict(msg))
            continue
        if role == "tool":
            msg = dict(msg, tool_call_id=engine_call_id(msg.get("tool_call_id")))
            if msg.get("tool_call_id") not in known_calls:
                out.append({"role": "user", "content": f"[result of tool call {msg.get('tool_call_id')}]\n"
                                                       f"{msg.get('content') or ''}"})
                continue
        out.append(msg)
    for m in out:
        if m.get("role") == "assistant" and m.get("tool_calls") and not m.get("content"):
            m["content"] = None
    if system_texts:
        out.insert(0, {"role": "system", "content": "\n\n".join(system_texts)})
    return out


def _merge_assistant(prev: dict, msg: dict) -> None:
    a, b = prev.get("content") or "", msg.get("content") or ""
    if isinstance(a, list):
        a = text_of(a)
    if isinstance(b, list):
        b = text_of(b)
    prev["content"] = (a + ("\n" if a and b else "") + b) or None
    if msg.get("tool_calls"):
        prev["tool_calls"] = (prev.get("tool_calls") or []) + msg["tool_calls"]
    if msg.get("reasoning"):
        prev["reasoning"] = (prev.get("reasoning") or "") + msg["reasoning"]


def function_tool(name: str, description: str | None, parameters: Any, strict: Any = None) -> dict:
    params = parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}
    fn = {"name": name, "parameters": params}
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}


def tool_call(call_id: str, name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {},
                                                                   ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


# --- reasoning signatures -------------------------------------------------------------------
# Anthropic thinking blocks need a signature; Claude Code may ask for thinking text to be
# omitted (`display: "omitted"`) and replays the empty block with the signature; Codex replays a
# Responses reasoning item by its `encrypted_content`; Gemini CLI drops thought parts from its
# history but keeps each part's `thoughtSignature`.  The gateway's signature carries the
# reasoning itself (zlib-compressed), so it is restored on replay and the next prompt keeps the
# exact prefix.  Decoding is capped (`app.proxy.limits.inflate`): a signature is the caller's
# input, and a forged one is a compression bomb.

SIGNATURE_PREFIX = "tsr1."
_MAGIC = SIGNATURE_PREFIX.encode("ascii")
_MAGIC_B64 = base64.b64encode(_MAGIC[:3]).decode("ascii")  # "dHNy": how the bytes form starts
_TO_STANDARD = str.maketrans("-_", "+/")


def reasoning_signature(text: str) -> str:
    """The text form (Anthropic `signature`, Responses `encrypted_content`): `tsr1.` + URL-safe
    base64 of the zlib-compressed UTF-8 reasoning."""
    return SIGNATURE_PREFIX + base64.urlsafe_b64encode(zlib.compress(text.encode("utf-8"))).decode("ascii")


def reasoning_signature_bytes(text: str) -> str:
    """The bytes form (Gemini `thoughtSignature`, a `bytes` field sent as base64: google-genai
    decodes either alphabet and re-encodes URL-safe): URL-safe base64 of `tsr1.` + the
    zlib-compressed UTF-8 reasoning."""
    return base64.urlsafe_b64encode(_MAGIC + zlib.compress(text.encode("utf-8"))).decode("ascii")


def _padded(b64: str) -> str:
    return b64 + "=" * (-len(b64) % 4)


def _signature_payload(sig: Any) -> bytes | None:
    """The compressed reasoning inside a signature of either form, None for any other value."""
    if not isinstance(sig, str) or not sig:
        return None
    try:
        if sig.startswith(SIGNATURE_PREFIX):
            return base64.urlsafe_b64decode(_padded(sig[len(SIGNATURE_PREFIX):]))
        if sig.startswith(_MAGIC_B64):
            raw = base64.b64decode(_padded(sig.translate(_TO_STANDARD)), validate=True)
            return raw[len(_MAGIC):] if raw.startswith(_MAGIC) else None
    except ValueError:  # binascii.Error: not base64
        return None
    return None


def reasoning_from_signature(sig: Any, where: str = "signature") -> str | None:
    """The reasoning text encoded in a signature the gateway issued (either form), else None
    (a foreign or damaged signature is just "unknown").

    Raises:
        GatewayError: too_large (413) when the signature inflates past its cap (`where` names it).
    """
    payload = _signature_payload(sig)
    if payload is None:
        return None
    try:
        return limits.inflate(payload, where).decode("utf-8")
    except ValueError:  # damaged zlib data, or not UTF-8 (UnicodeDecodeError is a ValueError)
        return None
