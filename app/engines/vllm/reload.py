"""vLLM adapter, weights: the reload client of a running ``vllm serve`` (``VLLMReloader``).

Weight reload (``VLLMReloader.reload``), the vLLM counterpart of the embedded engine's
``POST /v1/load_weights``:

1. ``POST /pause?mode=<weight update mode>&clear_cache=<recompute_kv>`` where the server has it
   (vLLM >= 0.2x with ``VLLM_SERVER_DEV_MODE=1``; https://docs.vllm.ai/en/latest/training/async_rl/):
   ``keep`` freezes queued and running requests, which continue on the new weights after
   ``/resume`` (``clear_cache=true`` recomputes their KV under the new weights); ``wait`` lets
   running requests finish first; ``abort`` ends them with their partial output
   (finish_reason "abort");
2. ``POST /collective_rpc`` → ``TurnstileWorkerExtension.turnstile_load_weights(DIR)`` on every worker;
3. ``POST /reset_prefix_cache``: cached KV blocks were computed with the old weights;
4. ``POST /resume``; then the pause is recorded (``app.weight_gate.record_update``).

vLLM does not know Turnstile's policy version, so its chunks carry none.  No token is produced
while the server is paused, so the gateway stamps each streamed chunk with the version of the
last recorded update whose pause ended before the chunk arrived (``app.versions.from_arrivals``):
a completion that spans a ``keep`` update gets its per-token versions from the engine's own
pause, never from a guess.  A server without ``/pause`` (older builds) loads without pausing
(logged once per server): its running requests then see the weights change between two steps,
like ``keep`` without a recorded boundary.  Runtime LoRA is the alternative for adapter training:
``--enable-lora`` with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``POST /v1/load_lora_adapter``
(``lora_adapter_args``); an adapter load never pauses (requests under the older adapter finish
on it).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from app.engines.client import EngineClient, EngineHTTPError

log = logging.getLogger(__name__)
_NO_PAUSE_LOGGED: set[str] = set()  # servers already reported as lacking /pause


class VLLMReloadError(RuntimeError):
    """A reload step failed; the message names the step and the server's answer."""


class VLLMReloader:
    """Weight reload for a running ``vllm serve`` started with ``serve_command`` (dev mode).

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:8200`` (no ``/v1``).
    """

    def __init__(self, base_url: str, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = EngineClient(base_url, timeout=timeout)
        self.policy_version: int | None = None

    def close(self) -> None:
        self._client.close()

    def _post(self, step: str, path: str, body: Any = None, **params: Any) -> Any:
        try:
            return self._client.request("POST", path, body, params=params or None)
        except EngineHTTPError as exc:
            raise VLLMReloadError(f"{step}: {path} answered {exc.status}: {exc.message[:500]}") from exc

    def reload(self, directory: str, policy_version: int, *, mode: str = "keep", recompute_kv: bool = True) -> dict:
        """Load the checkpoint ``directory`` into every worker in weight update ``mode``; return
        timings and receipts (``paused``: whether the server paused; ``mode``: the mode it paused in).

        Raises:
            ValueError: an unknown ``mode``.
            VLLMReloadError: the load, the prefix-cache reset or the resume failed (the server
                is resumed in any case when it was paused, so the old weights keep serving when
                the load failed).
            app.engines.client.EngineConnectionError: the server cannot be reached.
        """
        # Imported here: vLLM's worker processes import this package (worker.py) without Redis.
        from app import weight_gate
        from app.runconfig import WEIGHT_UPDATE_MODES

        if mode not in WEIGHT_UPDATE_MODES:
            raise ValueError(f"unknown weight update mode {mode!r}; choose one of {', '.join(WEIGHT_UPDATE_MODES)}")
        started = time.perf_counter()
        params = {"mode": mode, "clear_cache": "true" if recompute_kv else "false"}
        try:
            self._client.request("POST", "/pause", params=params)
            paused, paused_at = True, time.time()
        except EngineHTTPError as exc:  # older servers have no /pause
            if exc.status != 404 and exc.status != 405:
                raise VLLMReloadError(f"pause: /pause answered {exc.status}: {exc.message[:500]}") from exc
            paused, paused_at = False, time.time()
            if self.base_url not in _NO_PAUSE_LOGGED:
                _NO_PAUSE_LOGGED.add(self.base_url)
                log.warning("vLLM server %s has no /pause: weights load without pausing generation", self.base_url)
        try:
            receipt = self._post("load", "/collective_rpc", {"method": "turnstile_load_weights",
                                                             "args": [str(directory)]})
            self._post("reset_prefix_cache", "/reset_prefix_cache")
        finally:
            if paused:
                self._post("resume", "/resume")
        weight_gate.record_update(self.base_url, int(policy_version), paused_at, time.time())
        self.policy_version = int(policy_version)
        workers = receipt.get("results") if isinstance(receipt, dict) else None
        return {"policy_version": self.policy_version, "paused": paused, "mode": mode if paused else None,
                "load_s": round(time.perf_counter() - started, 3), "workers": workers}

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory for a colocated trainer (level 1: offload weights, drop KV cache)."""
        self._post("sleep", "/sleep", level=level)

    def wake_up(self) -> None:
        self._post("wake_up", "/wake_up")
