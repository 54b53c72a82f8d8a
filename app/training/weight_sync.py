"""Tell the inference engines to load new policy weights.

Two ways for the embedded engine (the engine server's protocol, app/engines/embedded):

* by path: `POST {engine_url}/v1/load_weights` with JSON `{"path": <checkpoint model dir>,
  "policy_version": N}`; the path is a directory on a filesystem the engine shares with the
  trainer (one machine, or a shared volume);
* pushed over HTTP (`app.engines.embedded.uploads`): every file of the folder is sent with its
  SHA-256 (`PUT /v1/checkpoints/N/<file>`), then `POST /v1/checkpoints/N/load` with the digests;
  the engine refuses a file whose digest differs, and the error lands in the step's
  `engine_sync` metrics.  No disk is shared.

`TURNSTILE_WEIGHT_TRANSFER` picks one: `path`, `push`, or `auto` (push to an engine whose URL
host is not a loopback address: such an engine is on another machine).  Either way the engine
answers `{"policy_version": N}` once it serves the new weights.  vLLM engines load by path
(`app.engines.vllm.VLLMReloader`), so they need the checkpoint folder on their own disk.
"""
from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from app import weight_gate
from app.config import get_settings
from app.engines.client import EngineCallError, EngineClient, EngineHTTPError, weights_label

log = logging.getLogger(__name__)


def push_weights(engine_urls: list[str], path: Path, policy_version: int, *, timeout_s: float = 300.0,
                 attempts: int = 3, engine_kind: str = "embedded", mode: str = "keep",
                 recompute_kv: bool = True) -> dict[str, str]:
    """Ask every engine to load `path` as `policy_version`; return `{url: "ok" | "error: …"}`.

    `mode` is the weight update mode (`app.runconfig.WeightUpdateMode`): `keep` lands the
    weights between two decode steps and running requests continue on them (`recompute_kv`:
    their KV is recomputed), `wait` drains running requests first, `abort` ends them.  Only
    `wait` closes the engine's gate (`weight_gate`): the gateway then holds new harness calls
    until the load is done.  Under `keep` and `abort` the engine takes new calls as soon as the
    weights are copied in, so no call waits longer than the copy itself.

    An embedded engine is told to name these weights `weights_label(path)` (the folder's real
    path here, on the trainer's side), so it reports that name whether it read the folder or
    received it over HTTP, and the watchdog can tell whether a restarted engine still serves them.

    Each engine gets up to `attempts` tries (connection errors, 5xx, a wrong version in the
    answer) with a short backoff; a failure is reported per engine, not raised, so every engine
    is tried and the caller sees which loaded: a training step then fails by name
    (`app.training.steps.WeightSyncError`), while its checkpoint stays the durable result and a
    failed engine keeps serving (and stamping) the old version.  `engine_kind` "vllm" reloads
    through vLLM's dev-mode endpoints (`app.engines.vllm.VLLMReloader`: pause in `mode`, load on
    every worker, reset the prefix cache, resume; the pause ends whatever the load does).
    """
    results: dict[str, str] = {}
    update = {"mode": mode, "recompute_kv": recompute_kv}
    for url in engine_urls:
        gate = weight_gate.reloading(url, policy_version) if mode == "wait" else contextlib.nullcontext()
        with gate:
            if engine_kind == "vllm":
                error = _load_vllm(url, path, policy_version, timeout_s, update)
            elif pushes_to(url):
                error = _push(url, path, policy_version, timeout_s, attempts, update)
            else:
                error = _load(url, path, policy_version, timeout_s, attempts, update)
        results[url] = "ok" if not error else f"error: {error}"
        if error:
            log.error("engine %s did not load policy_version=%s from %s: %s", url, policy_version, path, error)
    return results


def ensure_weights(engine_urls: list[str], path: Path, policy_version: int, *, engine_kind: str = "embedded",
                   attempts: int = 3) -> dict[str, str]:
    """Push `path` as `policy_version` to every engine that serves other weights; return
    `{url: "ok" | "error: …"}` for the engines it pushed to or could not ask, `{}` when none needed it.

    What an engine serves is read from `GET /v1/policy_version`: `(version, weights name)`, the name
    compared with `weights_label(path)`.  A policy version alone cannot tell a restarted engine
    from one still on a run's starting checkpoint (both are 0); the name can.  Left alone: an
    engine serving `path` at `policy_version`; one serving a newer version than `policy_version`
    (loaded since on purpose, e.g. a step the trainer pushed meanwhile: its own check covers it);
    vLLM and engines that report no name (they cannot be checked).  Asking is tried `attempts`
    times with a backoff.  Engine failures are reported in the answer; a Redis error of the reload
    gate (`weight_gate`) propagates.
    """
    if engine_kind == "vllm":
        return {}
    results: dict[str, str] = {}
    wanted = weights_label(path)
    for url in engine_urls:
        serving = _ask_serving(url, attempts)
        if isinstance(serving, str):
            results[url] = f"error: {serving}"
            continue
        version, name = serving
        if name is None or (name == wanted and version == policy_version) or (name != wanted and version > policy_version):
            continue
        log.warning("engine %s serves %s at policy_version=%s, not %s: loading it as policy_version=%s", url, name,
                    version, wanted, policy_version)
        results.update(push_weights([url], path, policy_version, engine_kind=engine_kind))
    return results


def _ask_serving(url: str, attempts: int) -> tuple[int, str | None] | str:
    """`EngineClient.serving` with retries and a backoff; the last error as a string if none answered."""
    error = "not tried"
    for attempt in range(attempts):
        try:
            with EngineClient(url, timeout=30) as client:
                return client.serving()
        except (EngineCallError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, EngineHTTPError) and 400 <= exc.status < 500:
                break  # the engine has no such route: asking again will not help
        if attempt + 1 < attempts:
            time.sleep(min(2.0**attempt, 10.0))
    return error


def _load(url: str, path: Path, policy_version: int, timeout_s: float, attempts: int, update: dict) -> str:
    """`EngineClient.reload` with retries; returns "" on success or the last error."""
    error = "not tried"
    with EngineClient(url, timeout=timeout_s) as client:
        for attempt in range(attempts):
            try:
                served = client.reload(str(path), policy_version, weights=weights_label(path), **update)
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


def pushes_to(engine_url: str) -> bool:
    """Whether a checkpoint is sent to this (embedded) engine over HTTP rather than by path."""
    mode = get_settings().weight_transfer
    if mode != "auto":
        return mode == "push"
    host = urlsplit(engine_url).hostname or ""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # a name other than localhost: another machine, as far as the trainer can tell


def checkpoint_digests(path: Path) -> dict[str, str]:
    """`{file name: SHA-256 hex}` of every regular file directly in checkpoint folder `path`."""
    digests = {}
    for item in sorted(Path(path).iterdir()):
        if item.is_file():
            digest = hashlib.sha256()
            with open(item, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
            digests[item.name] = digest.hexdigest()
    if not digests:
        raise FileNotFoundError(f"checkpoint folder {path} holds no files")
    return digests


def _push(url: str, path: Path, policy_version: int, timeout_s: float, attempts: int, update: dict) -> str:
    """Send the checkpoint's files with their digests, then load them; "" on success or the last error.
    A refusal (4xx: a digest mismatch, a bad token) is not retried."""
    from app.auth import api_token

    try:
        digests = checkpoint_digests(path)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    headers = {"Authorization": f"Bearer {api_token()}"}
    base = f"{url.rstrip('/')}/v1/checkpoints/{int(policy_version)}"
    error = "not tried"
    with httpx.Client(timeout=timeout_s, headers=headers) as client:
        for attempt in range(attempts):
            try:
                for name, digest in digests.items():
                    with open(Path(path) / name, "rb") as body:
                        _raise_for(client.put(f"{base}/{name}", content=body, headers={"X-Turnstile-Sha256": digest}))
                answer = client.post(f"{base}/load", json={"sha256": digests, "policy_version": int(policy_version),
                                                           "weights": weights_label(path), **update})
                _raise_for(answer)
                served = answer.json()["policy_version"]
                if served == policy_version:
                    return ""
                error = f"engine answered policy_version={served}, expected {policy_version}"
            except _Refused as exc:
                return str(exc)
            except (httpx.HTTPError, OSError, KeyError, TypeError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            if attempt + 1 < attempts:
                time.sleep(min(2.0**attempt, 10.0))
    return error


class _Refused(Exception):
    """The engine answered 4xx: it refused this checkpoint or request; repeating it will not help."""


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:500]
    where = f"{response.request.method} {response.request.url.path}"
    if response.status_code < 500:
        raise _Refused(f"{where}: {response.status_code} {message}")
    raise httpx.HTTPStatusError(f"{where}: {response.status_code} {message}", request=response.request,
                                response=response)


def _load_vllm(url: str, path: Path, policy_version: int, timeout_s: float, update: dict) -> str:
    """Reload a vLLM server through ``VLLMReloader`` (run against vLLM's CPU build in tests/vllm)."""
    from app.engines.vllm import VLLMReloader

    reloader = VLLMReloader(url, timeout=timeout_s)
    try:
        reloader.reload(str(path), policy_version, **update)
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


def push_adapter(engine_urls: list[str], folder: Path, name: str, policy_version: int, *, timeout_s: float = 120.0,
                 attempts: int = 3, engine_kind: str = "embedded") -> dict[str, str]:
    """Ask every engine to serve the LoRA adapter in `folder` as `name` (`<label>@<content hash>`,
    `app.engines.embedded.adapters`) for `policy_version`; return `{url: "ok" | "error: …"}`.
    The base weights and the other runs' adapters stay as they are.  By path only: the engine
    reads `folder` from a disk it shares with the trainer.  `engine_kind` "vllm" loads the
    folder's PEFT files through vLLM's runtime LoRA route (`app.engines.vllm.lora`), which also
    unloads the run's versions older than the one before.  A refusal (4xx: a corrupted file, a
    bad token, a rank above the server's `--max-lora-rank`) is not retried; connection errors and
    5xx are."""
    results: dict[str, str] = {}
    for url in engine_urls:
        error = "not tried"
        for attempt in range(attempts):
            error, retry = _load_adapter(url, folder, name, policy_version, timeout_s, engine_kind)
            if not error or not retry:
                break
            time.sleep(0.5 * (attempt + 1))
        results[url] = "ok" if not error else f"error: {error}"
        if error:
            log.error("engine %s did not load adapter %s (policy_version=%s): %s", url, name, policy_version, error)
    return results


def _load_adapter(url: str, folder: Path, name: str, policy_version: int, timeout_s: float,
                  engine_kind: str) -> tuple[str, bool]:
    """`("", False)` once the engine serves the adapter, else `(error, worth retrying)`: both
    engines take `POST /v1/load_lora_adapter` (`EngineClient.load_lora_adapter`); vLLM has no
    policy versions (the gateway stamps the step's) and its older versions are unloaded
    (`app.engines.vllm.lora.load_adapter`)."""
    from app.engines.vllm.lora import VLLMAdapterError, load_adapter

    try:
        with EngineClient(url, timeout=timeout_s) as client:
            if engine_kind == "vllm":
                load_adapter(client, name, folder)
            else:
                client.load_lora_adapter(name, str(folder), policy_version)
    except VLLMAdapterError as exc:
        cause = exc.__cause__
        return str(exc), isinstance(cause, EngineHTTPError) and cause.status >= 500
    except EngineHTTPError as exc:
        return f"engine answered {exc.status}: {exc.message[:500]}", exc.status >= 500
    except EngineCallError as exc:
        return f"{type(exc).__name__}: {exc}", True
    return "", False
