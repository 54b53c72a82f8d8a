"""Which client API a request speaks: by path, then headers, then body.

Base URLs arrive with and without `/v1` or `/v1beta` (Claude Code and the
Anthropic SDK add `/v1` themselves, OpenAI clients include it, Gemini clients
omit `/v1beta` except pi), so paths are matched by suffix.
"""
from __future__ import annotations

from dataclasses import dataclass

APIS = ("anthropic", "chat", "responses", "gemini")


@dataclass(frozen=True)
class Route:
    """api: anthropic | chat | responses | gemini; op: generate | count_tokens | models | model | retrieve;
    model/stream only for Gemini (they live in its path)."""

    api: str
    op: str
    model: str | None = None
    stream: bool = False
    resource: str | None = None


def _gemini(path: str) -> Route | None:
    if ":" not in path:
        return None
    head, _, method = path.rpartition(":")
    name = head.rsplit("/models/", 1)[-1] if "/models/" in head else head.rsplit("/", 1)[-1]
    if method == "generateContent":
        return Route("gemini", "generate", name, False)
    if method == "streamGenerateContent":
        return Route("gemini", "generate", name, True)
    if method == "countTokens":
        return Route("gemini", "count_tokens", name)
    return Route("gemini", "unsupported", name, resource=method)


def detect(method: str, path: str, headers, body: dict | None) -> Route | None:
    """The route for a request, or None when nothing identifies the API."""
    p = "/" + path.strip("/")
    if method in ("GET", "HEAD"):
        if p.endswith("/models") or p == "/models":
            if headers.get("anthropic-version"):
                return Route("anthropic", "models")
            if "v1beta" in p or headers.get("x-goog-api-key"):
                return Route("gemini", "models")
            return Route("chat", "models")
        if "/responses/" in p:
            return Route("responses", "retrieve", resource=p.rsplit("/", 1)[-1])
        if "/models/" in p and "v1beta" in p:
            return Route("gemini", "model", p.rsplit("/models/", 1)[-1])
        return None
    route = _gemini(p)
    if route is not None:
        return route
    if p.endswith("/messages/count_tokens"):
        return Route("anthropic", "count_tokens")
    if p.endswith("/messages"):
        return Route("anthropic", "generate")
    if p.endswith("/chat/completions"):
        return Route("chat", "generate")
    if p.endswith("/responses"):
        return Route("responses", "generate")
    # Unknown path: headers, then the body's shape.
    if headers.get("anthropic-version"):
        return Route("anthropic", "generate")
    if headers.get("x-goog-api-key"):
        return Route("gemini", "generate", "default", False)
    if isinstance(body, dict):
        if "contents" in body:
            return Route("gemini", "generate", "default", False)
        if "input" in body:
            return Route("responses", "generate")
        if "messages" in body:
            return Route("anthropic" if "system" in body and "max_tokens" in body else "chat", "generate")
    return None


def api_from_headers(path: str, headers) -> str:
    """Best guess of the caller's API for error shapes when routing failed."""
    if headers.get("anthropic-version") or path.rstrip("/").endswith("/messages"):
        return "anthropic"
    if headers.get("x-goog-api-key") or "v1beta" in path or ":" in path:
        return "gemini"
    return "chat"
