"""Tell the inference engines to load new policy weights.

Protocol (the engine server's, app/engines): `POST {engine_url}/v1/load_weights` with JSON
`{"path": <checkpoint model dir>, "policy_version": N}`; the engine answers
`{"policy_version": N}` once it serves the new weights.  The path is a directory on a
filesystem the engine shares with the trainer (one box, or a shared volume).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from app import weight_gate
from app.engines.client import EngineCallError, EngineClient, EngineHTTPError

log = logging.getLogger(__name__)


def push_weights(engine_urls: list[str], path: Path, policy_version: int, *, timeout_s: float = 300.0,
                 attempts: int = 3, engine_kind: str = "embedded") -> dict[str, str]:
    """Ask every engine to load `path` as `policy_version`; return `{url: "ok" | "error: …"}`.

    Each engine gets up to `attempts` tries (connection errors, 5xx, a wrong version in the
    answer) with a short backoff; a failure is reported, not raised, because the checkpoint
    is already the durable result of the step and the engine stamps the version it actually
    serves on every completion, so stale samples stay visible to the trainer (TIS) and the
    scheduler (staleness).  `engine_kind` "vllm" reloads through vLLM's dev-mode endpoints
    (`app.engines.vllm.VLLMReloader`: pause, load on every worker, reset the prefix cache, resume).
    """
    results: dict[str, str] = {}
    for url in engine_urls:
        # Close the engine's gate: the gateway holds new harness calls (with keep-alives)
        # instead of sending them to an engine that is swapping weights.
        with weight_gate.reloading(url, policy_version):
            if engine_kind == "vllm":
                error = _load_vllm(url, path, policy_version, timeout_s)
            else:
                error = _load(url, path, policy_version, timeout_s, attempts)
        results[url] = "ok" if not error else f"error: {error}"
        if error:
            log.error("engine %s did not load policy_version=%s from %s: %s", url, policy_version, path, error)
    return results


def _load(url: str, path: Path, policy_version: int, timeout_s: float, attempts: int) -> str:
    """`EngineClient.reload` with retries; returns "" on success or the last error."""
    error = "not tried"
    with EngineClient(url, timeout=timeout_s) as client:
        for attempt in range(attempts):
            try:
                served = client.reload(str(path), policy_version)
                if served == policy_version:
                    return ""
                error = f"engine answered policy_version={served}, expected {policy_version}"
            except EngineHTTPError as exc:
                error = str(exc)
                if 400 <= exc.status < 500:
                    return error  # the engine refused this request; repeating it will not help
            except (EngineCallError, KeyError, TypeError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            if attempt + 1 < attempts:
                time.sleep(min(2.0**attempt, 10.0))
    return error


def _load_vllm(url: str, path: Path, policy_version: int, timeout_s: float) -> str:
    """Reload a vLLM server through ``VLLMReloader`` (run against vLLM's CPU build in tests/vllm)."""
    from app.engines.vllm import VLLMReloader

    reloader = VLLMReloader(url, timeout=timeout_s)
    try:
        reloader.reload(str(path), policy_version)
        return ""
    except Exception as exc:  # noqa: BLE001 - reported per engine like the embedded path
        return f"{type(exc).__name__}: {exc}"
    finally:
        reloader.close()


def reset_to_base(engine_urls: list[str], timeout_s: float = 300.0) -> dict[str, str]:
    """Put embedded engines back on the weights they were started with, as policy version 0.

    Embedded engines only (`EngineClient.reset_to_base`: `POST /v1/load_weights {"base": true,
    "policy_version": 0}`); returns `{url: "ok" | "error: …"}`, never raises.
    """
    results: dict[str, str] = {}
    for url in engine_urls:
        with weight_gate.reloading(url, 0):
            try:
                with EngineClient(url, timeout=timeout_s) as client:
                    served = client.reset_to_base()
                results[url] = "ok" if served == 0 else f"error: engine answered policy_version={served}, expected 0"
            except (EngineCallError, KeyError, TypeError, ValueError) as exc:
                results[url] = f"error: {type(exc).__name__}: {exc}"
    return results
