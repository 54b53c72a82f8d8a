"""HTTP client for an inference engine (embedded engine or vLLM) used by the gateway and trainer.

``EngineClient`` speaks the engine contract documented in ``app.engines.server``; with a
vLLM server the same calls work except ``reload`` (use ``app.engines.vllm.VLLMReloader``).
"""
from __future__ import annotations

import json
import time
from typing import Any, Iterator

import httpx


class EngineHTTPError(RuntimeError):
    """Non-2xx answer from the engine; ``status`` and the parsed ``body`` are kept."""

    def __init__(self, status: int, body: Any) -> None:
        message = body.get("error", {}).get("message") if isinstance(body, dict) and isinstance(body.get("error"), dict) else body
        super().__init__(f"engine answered {status}: {message}")
        self.status, self.body = status, body


class EngineClient:
    """Synchronous client.  ``base_url`` is the server root (``http://127.0.0.1:8200``, no ``/v1``).

    Args:
        timeout: seconds per request (generation can be long on CPU; default 600).
    """

    def __init__(self, base_url: str, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _json(self, response: httpx.Response) -> Any:
        try:
            body = response.json()
        except ValueError:
            body = response.text
        if response.status_code >= 400:
            raise EngineHTTPError(response.status_code, body)
        return body

    def health(self, wait_s: float = 0.0) -> dict:
        """``GET /health``; with ``wait_s`` > 0 retry connection errors / 5xx until it answers.

        Raises:
            TimeoutError: not healthy within ``wait_s`` seconds.
        """
        deadline = time.monotonic() + wait_s
        while True:
            try:
                response = self._http.get("/health", timeout=5.0)
                if response.status_code == 200:
                    try:
                        return response.json()
                    except ValueError:
                        return {"status": "ok"}  # vLLM answers an empty body
                last = f"status {response.status_code}"
            except httpx.HTTPError as exc:
                last = str(exc)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"engine {self.base_url} not healthy after {wait_s:.0f}s ({last})")
            time.sleep(0.2)

    def chat(self, messages: list[dict], *, stream: bool = False, **fields: Any) -> dict | Iterator[dict]:
        """``POST /v1/chat/completions``.  Extra keyword fields go into the JSON body verbatim
        (``max_tokens``, ``temperature``, ``seed``, ``tools``, ``logprobs``, ``return_token_ids`` …).

        Returns the response object, or (``stream=True``) an iterator of chunk objects that
        stops at ``[DONE]``.  Raises ``EngineHTTPError`` on 4xx/5xx.
        """
        body = {"messages": messages, **fields}
        if not stream:
            return self._json(self._http.post("/v1/chat/completions", json=body))
        return self._stream(body)

    def _stream(self, body: dict) -> Iterator[dict]:
        with self._http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            if response.status_code >= 400:
                response.read()
                self._json(response)
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk and "choices" not in chunk:
                    raise EngineHTTPError(chunk["error"].get("code") or 500, chunk)
                yield chunk

    def tokenize(self, messages: list[dict] | None = None, *, prompt: str | None = None,
                 tools: list | None = None, add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids exactly as the engine renders them (``POST /tokenize``)."""
        body: dict[str, Any] = {"prompt": prompt} if messages is None else {
            "messages": messages, "add_generation_prompt": add_generation_prompt}
        if tools:
            body["tools"] = tools
        return self._json(self._http.post("/tokenize", json=body))["tokens"]

    def detokenize(self, tokens: list[int]) -> str:
        return self._json(self._http.post("/detokenize", json={"tokens": tokens}))["prompt"]

    def policy_version(self) -> int:
        return int(self._json(self._http.get("/v1/policy_version"))["policy_version"])

    def reload(self, path: str, policy_version: int) -> int:
        """Load the checkpoint directory ``path`` and tag later completions with ``policy_version``.

        Blocks until requests already running have finished on the old weights and the new
        weights are in place; returns the engine's new policy version.
        """
        body = {"path": str(path), "policy_version": int(policy_version)}
        return int(self._json(self._http.post("/v1/load_weights", json=body))["policy_version"])
