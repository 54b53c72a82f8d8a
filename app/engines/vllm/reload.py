"""vLLM adapter, weights: the reload client of a running ``vllm serve`` (``VLLMReloader``).

Weight reload (``VLLMReloader.reload``), the vLLM counterpart of the embedded engine's
``POST /v1/load_weights``:

1. ``POST /pause?mode=wait`` where the server has it (2026 builds): running requests finish on
   the old weights, new ones are held;
2. ``POST /collective_rpc`` → ``TurnstileWorkerExtension.turnstile_load_weights(DIR)`` on every worker;
3. ``POST /reset_prefix_cache``: cached KV blocks were computed with the old weights;
4. ``POST /resume``.

vLLM does not know Turnstile's policy version, so responses carry none: the gateway tags a
completion with the version of the last reload that finished before the completion's first
token arrived (exact when step 1 is available, since generation is then never split across
weights).  Runtime LoRA is the alternative for adapter training: ``--enable-lora`` with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``POST /v1/load_lora_adapter`` (``lora_adapter_args``).
"""
from __future__ import annotations

import time
from typing import Any

from app.engines.client import EngineClient, EngineHTTPError


class VLLMReloadError(RuntimeError):
    """A reload step failed; the message names the step and the server's answer."""


class VLLMReloader:
    """Weight reload for a running ``vllm serve`` started with ``serve_command`` (dev mode).

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:8200`` (no ``/v1``).
    """

    def __init__(self, base_url: str, timeout: float = 600.0) -> None:
        self._client = EngineClient(base_url, timeout=timeout)
        self.policy_version: int | None = None

    def close(self) -> None:
        self._client.close()

    def _post(self, step: str, path: str, body: Any = None, **params: Any) -> Any:
        try:
            return self._client.request("POST", path, body, params=params or None)
        except EngineHTTPError as exc:
            raise VLLMReloadError(f"{step}: {path} answered {exc.status}: {exc.message[:500]}") from exc

    def reload(self, directory: str, policy_version: int) -> dict:
        """Load the checkpoint ``directory`` into every worker; return timings and receipts.

        Raises:
            VLLMReloadError: the load, the prefix-cache reset or the resume failed (the server
                is resumed in any case when it was paused).
            app.engines.client.EngineConnectionError: the server cannot be reached.
        """
        started = time.perf_counter()
        try:
            self._client.request("POST", "/pause", params={"mode": "wait"})
            paused = True
        except EngineHTTPError:  # older servers have no /pause
            paused = False
        try:
            receipt = self._post("load", "/collective_rpc", {"method": "turnstile_load_weights",
                                                             "args": [str(directory)]})
            self._post("reset_prefix_cache", "/reset_prefix_cache")
        finally:
            if paused:
                self._post("resume", "/resume")
        self.policy_version = int(policy_version)
        workers = receipt.get("results") if isinstance(receipt, dict) else None
        return {"policy_version": self.policy_version, "paused": paused,
                "load_s": round(time.perf_counter() - started, 3), "workers": workers}

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory for a colocated trainer (level 1: offload weights, drop KV cache)."""
        self._post("sleep", "/sleep", level=level)

    def wake_up(self) -> None:
        self._post("wake_up", "/wake_up")
