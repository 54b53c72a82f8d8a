"""Checkpoints sent to the embedded engine over HTTP, checked by SHA-256 (no shared disk needed).

The trainer (`app.training.weight_sync`) sends a checkpoint to an engine on another machine in
two admin requests (both need ``Authorization: Bearer <API token>``):

1. ``PUT /v1/checkpoints/<version>/<file>`` for every file of the checkpoint folder, with header
   ``X-Turnstile-Sha256: <hex digest>``.  The body is streamed to the engine's own var folder
   (``<TURNSTILE_VAR_DIR>/engine-uploads/<engine id>/v<version>/``) while it is hashed; a digest
   that differs from the header is a 400 ("sha256 mismatch ... refused") and the file is deleted.
2. ``POST /v1/checkpoints/<version>/load {"sha256": {file: hex, ...}, "policy_version": N, "weights"}``:
   the manifest must name exactly the files received for that version with the digests they were
   received with (else a 400 naming the file); then the weights are read and swapped in like
   ``POST /v1/load_weights`` does, and the received files are deleted (the weights are in memory).
   ``weights`` names them (what ``GET /v1/policy_version`` reports); without it the name is
   ``sha256:<SHA-256 of the manifest as sorted JSON>``.

Answers are the engine's usual ones (``{"policy_version", "engine_id", "weights", "load_s"}``; errors in
vLLM's error body).
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from pathlib import Path
from typing import Callable

from flask import Flask, jsonify, request

from app.engines.embedded.engine import Engine
from app.engines.embedded.validation import EngineError, get_field, json_body, update_mode_fields, weights_name
from app.engines.modeling import read_state_dict

SHA_HEADER = "X-Turnstile-Sha256"
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HEX = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 1 << 20


def upload_root(engine: Engine) -> Path:
    """Folder of this engine's received checkpoints (in its own var folder)."""
    from app.config import get_settings

    safe = re.sub(r"[^A-Za-z0-9._-]", "_", engine.engine_id)
    return get_settings().var_dir / "engine-uploads" / safe


def register(app: Flask, engine: Engine, require_admin: Callable[[], None]) -> None:
    """Add the two checkpoint routes to the engine's Flask app."""
    received: dict[int, dict[str, str]] = {}  # version -> {file name: sha256 verified on receipt}

    @app.put("/v1/checkpoints/<int:version>/<name>")
    def put_checkpoint_file(version: int, name: str):
        require_admin()
        if not _FILE_NAME.match(name):
            raise EngineError(f"checkpoint file name {name!r} is not a plain file name", param="name")
        expected = (request.headers.get(SHA_HEADER) or "").lower()
        if not _HEX.match(expected):
            raise EngineError(f"{SHA_HEADER}: give the file's SHA-256 as 64 hex digits", param=SHA_HEADER)
        folder = upload_root(engine) / f"v{version}"
        folder.mkdir(parents=True, exist_ok=True)
        target, partial = folder / name, folder / f".{name}.partial"
        digest, size = hashlib.sha256(), 0
        with open(partial, "wb") as out:
            while chunk := request.stream.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
        got = digest.hexdigest()
        if got != expected:
            partial.unlink(missing_ok=True)
            received.get(version, {}).pop(name, None)
            raise EngineError(f"checkpoint file {name} of version {version}: sha256 mismatch (received {got}, "
                              f"expected {expected}, {size} bytes): refused", param=SHA_HEADER)
        partial.replace(target)
        received.setdefault(version, {})[name] = got
        return jsonify({"name": name, "sha256": got, "bytes": size}), 201

    @app.post("/v1/checkpoints/<int:version>/load")
    def load_checkpoint(version: int):
        require_admin()
        body = json_body()
        manifest = get_field(body, "sha256", dict)
        if not manifest:
            raise EngineError("'sha256' must map every checkpoint file to its SHA-256", param="sha256")
        policy_version = get_field(body, "policy_version", int, version)
        # Without a name from the trainer, the manifest's own digest names the content.
        weights = weights_name(body, "sha256:" + hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest())
        have = received.get(version, {})
        folder = upload_root(engine) / f"v{version}"
        for name, digest in sorted(manifest.items()):
            if name not in have:
                raise EngineError(f"checkpoint file {name} of version {version} was not received", param="sha256")
            if have[name] != str(digest).lower():
                raise EngineError(f"checkpoint file {name} of version {version}: sha256 mismatch (received "
                                  f"{have[name]}, manifest {digest}): refused", param="sha256")
        extra = sorted(set(have) - set(manifest))
        if extra:
            raise EngineError(f"files not in the manifest were received for version {version}: {', '.join(extra)}",
                              param="sha256")
        started = time.perf_counter()
        try:
            state = read_state_dict(folder)
        except Exception as exc:  # safetensors raises its own SafetensorError on corrupt files
            raise EngineError(f"cannot read checkpoint version {version}: {exc}", param="sha256") from exc
        try:
            new_version = engine.scheduler.reload(state, policy_version, weights, **update_mode_fields(body))
        except (ValueError, RuntimeError) as exc:
            raise EngineError(f"checkpoint does not fit the served model: {exc}", param="sha256") from exc
        finally:
            received.pop(version, None)
            shutil.rmtree(folder, ignore_errors=True)  # the weights are in memory now
        return jsonify({"policy_version": new_version, "engine_id": engine.engine_id, "weights": weights,
                        "load_s": round(time.perf_counter() - started, 3), "sha256": dict(sorted(manifest.items()))})
