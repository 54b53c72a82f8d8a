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

Steps 1-3 share one deadline (``weight_pause_timeout_s``) and step 4 runs however they end, so a
load that fails or hangs does not keep the server paused past it (except where vLLM runs its worker
in process, which ignores collective_rpc's ``timeout``: a hung load holds the engine core there, and
the resume runs when it ends); a reloader killed mid-update leaves its pause record in Redis
(``app.weight_gate.record_pause``), and the watchdog resumes that server once the record is older
than the deadline (``app.control.engine_pauses``).

vLLM does not know Turnstile's policy version, so its chunks carry none.  No token is produced
while the server is paused, so the gateway stamps each streamed chunk with the version of the
last recorded update whose pause ended before the chunk arrived (``app.versions.from_arrivals``):
a completion that spans a ``keep`` update gets its per-token versions from the engine's own
pause, never from a guess.  A server without ``/pause`` (older builds) loads without pausing
(logged once per server): its running requests then see the weights change between two steps,
like ``keep`` without a recorded boundary (a full-weights ``keep`` run is refused on such a server
at creation: ``app.control.preflight.check_pause_support``).  Runtime LoRA is the alternative for adapter training:
``--enable-lora`` with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``POST /v1/load_lora_adapter``
(``lora_adapter_args``); an adapter load never pauses (requests under the older adapter finish
on it).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import httpx

from app.engines.client import EngineClient, EngineConnectionError, EngineHTTPError

log = logging.getLogger(__name__)
RESUME_TIMEOUT_S = 30.0  # a resume only flips a flag in the engine; past this the watchdog tries again
_NO_PAUSE_LOGGED: set[str] = set()  # servers already reported as lacking /pause


class VLLMReloadError(RuntimeError):
    """A reload step failed; the message names the step and the server's answer."""


class VLLMReloader:
    """Weight reload for a running ``vllm serve`` started with ``serve_command`` (dev mode).

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:8200`` (no ``/v1``).
        timeout: read timeout of the other calls (sleep, wake up), seconds.
        pause_timeout_s: the longest one reload keeps the server paused, seconds (default: the
            ``weight_pause_timeout_s`` setting, read at each reload).
    """

    def __init__(self, base_url: str, timeout: float = 600.0, *, pause_timeout_s: float | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.pause_timeout_s = pause_timeout_s
        self._client = EngineClient(base_url, timeout=timeout)
        self.policy_version: int | None = None

    def close(self) -> None:
        self._client.close()

    def _post(self, step: str, path: str, body: Any = None, *, timeout: float | None = None, **params: Any) -> Any:
        try:
            return self._client.request("POST", path, body, params=params or None, timeout=timeout)
        except EngineHTTPError as exc:
            raise VLLMReloadError(f"{step}: {path} answered {exc.status}: {exc.message[:500]}") from exc
        except EngineConnectionError as exc:
            if not exc.timed_out:
                raise
            raise VLLMReloadError(f"{step}: {path} did not answer within {timeout or 0:.0f} s "
                                  "(weight_pause_timeout_s)") from exc

    def reload(self, directory: str, policy_version: int, *, mode: str = "keep", recompute_kv: bool = True) -> dict:
        """Load the checkpoint ``directory`` into every worker in weight update ``mode``; return
        timings and receipts (``paused``: whether the server paused; ``mode``: the mode it paused in).

        The pause never outlives the update: the pause, the load and the prefix-cache reset share
        one deadline, ``pause_timeout_s`` (default: the ``weight_pause_timeout_s`` setting; each
        call's read timeout is what is left of it), and ``/resume`` is sent whatever ended them.
        The pause is recorded in Redis before it is asked for (``weight_gate.record_pause``) and
        forgotten once ``/resume`` answered, so a reloader killed meanwhile (or a ``/resume`` that
        failed) leaves a record the watchdog acts on (``app.control.engine_pauses``).

        Raises:
            ValueError: an unknown ``mode``.
            VLLMReloadError: the pause, the load, the prefix-cache reset or the resume failed or
                passed the deadline (the server is resumed in any case when it may be paused, so
                the old weights keep serving when the load failed).
            app.engines.client.EngineConnectionError: the server cannot be reached.
            redis.RedisError: the pause cannot be recorded (nothing was asked of the server).
        """
        # Imported here: vLLM's worker processes import this package (worker.py) without Redis.
        from app import weight_gate
        from app.config import get_settings
        from app.runconfig import WEIGHT_UPDATE_MODES

        if mode not in WEIGHT_UPDATE_MODES:
            raise ValueError(f"unknown weight update mode {mode!r}; choose one of {', '.join(WEIGHT_UPDATE_MODES)}")
        limit = self.pause_timeout_s or get_settings().weight_pause_timeout_s
        started, deadline = time.perf_counter(), time.monotonic() + limit

        def left() -> float:
            return max(1.0, deadline - time.monotonic())

        params = {"mode": mode, "clear_cache": "true" if recompute_kv else "false"}
        paused_at = time.time()
        record = weight_gate.record_pause(self.base_url, int(policy_version), paused_at)
        try:
            paused = self._pause(params, left())
        except BaseException as exc:
            if isinstance(exc, EngineConnectionError) and isinstance(exc.__cause__, httpx.ConnectError):
                weight_gate.clear_pause(self.base_url, record)  # never reached the server: nothing paused
            else:
                # A /pause that timed out (``wait`` drains running requests first) may have paused the server.
                self._resume(record, after=exc)
            raise
        if not paused:
            weight_gate.clear_pause(self.base_url, record)
        try:
            # vLLM's own `timeout` stops the engine core waiting for its workers at the deadline
            # (the multiproc executor honours it), so the `/resume` below is not queued behind a
            # hung load; an in-process executor runs the load to its end before it resumes.
            receipt = self._post("load", "/collective_rpc", {"method": "turnstile_load_weights",
                                                             "args": [str(directory)], "timeout": left()},
                                 timeout=left())
            self._post("reset_prefix_cache", "/reset_prefix_cache", timeout=left())
        except BaseException as exc:
            if paused:
                self._resume(record, after=exc)
            raise
        if paused:
            self._resume(record)
        weight_gate.record_update(self.base_url, int(policy_version), paused_at, time.time())
        self.policy_version = int(policy_version)
        workers = receipt.get("results") if isinstance(receipt, dict) else None
        return {"policy_version": self.policy_version, "paused": paused, "mode": mode if paused else None,
                "load_s": round(time.perf_counter() - started, 3), "workers": workers}

    def _pause(self, params: dict, timeout: float) -> bool:
        """``POST /pause``; False when the server has none (404/405: older builds, logged once)."""
        try:
            self._post("pause", "/pause", timeout=timeout, **params)
            return True
        except VLLMReloadError as exc:
            cause = exc.__cause__
            if not isinstance(cause, EngineHTTPError) or cause.status not in (404, 405):
                raise
        if self.base_url not in _NO_PAUSE_LOGGED:
            _NO_PAUSE_LOGGED.add(self.base_url)
            log.warning("vLLM server %s has no /pause: weights load without pausing generation", self.base_url)
        return False

    def _resume(self, record: str, after: BaseException | None = None) -> None:
        """``POST /resume`` and forget the pause record ``record``.  After another error (``after``)
        a failed resume is logged, not raised (that error is the one the caller sees); the record
        then stays for the watchdog."""
        from app import weight_gate

        try:
            self._post("resume", "/resume", timeout=RESUME_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the watchdog resumes it from the record
            if after is None:
                raise
            log.error("vLLM server %s: /resume after %s failed (%s); the watchdog resumes it after "
                      "weight_pause_timeout_s", self.base_url, type(after).__name__, exc)
            return
        weight_gate.clear_pause(self.base_url, record)

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory for a colocated trainer (level 1: offload weights, drop KV cache)."""
        self._post("sleep", "/sleep", level=level)

    def wake_up(self) -> None:
        self._post("wake_up", "/wake_up")
