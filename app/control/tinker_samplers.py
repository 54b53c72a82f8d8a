"""Sampler checkpoints of Tinker models: named LoRA adapter versions the engines load, and which
one a sample request may use.

`TrainingClient.save_weights_for_sampler(name)` answers with the path
`tinker://<model id>/sampler_weights/<name>` (the SDK parses it as
`ParsedCheckpointTinkerPath`: three segments after `tinker://`, the middle one `sampler_weights`);
`save_weights_and_get_sampling_client()` sends no name and gets a sampling session id instead.
Either way the gpu task writes the tenant's adapter (the engines' folder layout,
`app.engines.lora_format`) into `sampler_folder(run_id, name)` and calls `publish`, which

* pushes it to every engine under its served name `run-<run id>@<sha256[:12]>`
  (`app.training.weight_sync.push_adapter`, as a LoRA train run's step does: the name carries
  the content hash, so a name never stands for two contents and a rewritten file is refused);
* for a save without a name, creates the sampling session the SDK then samples with.

`resolve` is the sampler side's isolation rule: a sample request is answered under an adapter
only if the sampling session, the model and the sampler path all belong to the API key that sent
the request; anything else is refused as if it did not exist (the same words for another key's
model and a missing one).  The adapter's folder lives under the model's own run folder, which no
other key's path can name: a sampler name is one path segment of `[A-Za-z0-9._-]`.
"""
from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.config import get_settings
from app.control.tinker_sampling import SampleError
from app.engines.lora_format import WEIGHTS, adapter_name, run_label
from app.paths import RunPaths
from app.tables import TinkerFuture, TinkerModel, TinkerSamplingSession
from app.training.weight_sync import push_adapter

SAMPLER_KIND = "sampler_weights"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str) -> str:
    """`name` if it can name a sampler checkpoint (one path segment); else `SampleError`."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise SampleError(f"sampler name {name!r}: use 1-128 letters, digits, '.', '_' or '-' (no '/', no '..')")
    return name


def sampler_path(model_id: str, name: str) -> str:
    """The SDK's path of sampler checkpoint `name` of `model_id`."""
    return f"tinker://{model_id}/{SAMPLER_KIND}/{check_name(name)}"


def parse_sampler_path(path: str) -> tuple[str, str]:
    """`(model id, name)` of `tinker://<model id>/sampler_weights/<name>`.

    Raises `SampleError` for another form; a training-state path (`.../weights/...`) is named as
    such, since only sampler checkpoints are sampled from."""
    parts = path[len("tinker://"):].split("/") if isinstance(path, str) and path.startswith("tinker://") else []
    if len(parts) != 3 or not parts[0]:
        raise SampleError(f"{path!r} is not a tinker://<model id>/{SAMPLER_KIND}/<name> path")
    if parts[1] != SAMPLER_KIND:
        raise SampleError(f"{path!r} is a {parts[1]!r} checkpoint; sampling needs one saved by "
                          f"save_weights_for_sampler (tinker://<model id>/{SAMPLER_KIND}/<name>)")
    return parts[0], check_name(parts[2])


def sampler_folder(run_id: int, name: str) -> Path:
    """Where the adapter of sampler checkpoint `name` of the model trained as run `run_id` lives."""
    return RunPaths(run_id).root / "tinker" / SAMPLER_KIND / check_name(name)


def ephemeral_name(session_id: str | None = None, sampling_seq_id: int | None = None) -> str:
    """The name of a sampler saved without one (`save_weights_and_get_sampling_client`): fixed by
    the SDK session and its sampling sequence number when given, so a save re-run after its worker
    died writes the same folder and finds the same sampling session; else a random one."""
    if session_id is None or sampling_seq_id is None:
        return f"ephemeral-{uuid.uuid4().hex[:16]}"
    digest = hashlib.blake2b(session_id.encode(), digest_size=4).hexdigest()
    return f"ephemeral-{digest}-{int(sampling_seq_id)}"


def publish(s: Session, model: TinkerModel, name: str, *, session_id: str | None = None,
            sampling_seq_id: int | None = None, engine_urls: list[str] | None = None) -> dict:
    """Serve the adapter the gpu task wrote to `sampler_folder(model.run_id, name)` from every
    engine; return the `save_weights_for_sampler` result the SDK reads:
    `{"path": tinker://..., "type": "save_weights_for_sampler"}`, or, when `sampling_seq_id` is
    given (a save without a name: the request's `sampling_session_seq_id`, and `name` then
    `ephemeral_name(session_id, sampling_seq_id)`), `{"sampling_session_id": ...}` of the sampling
    session (sequence `sampling_seq_id` of SDK session `session_id`, default the model's) on it.

    How the gpu task saves for the sampler: write the tenant's adapter with
    `app.training.tinker_ops.save_engine_adapter(pool, state, sampler_folder(run_id, name))`, then
    `publish(...)` and complete the future with its answer.

    Raises:
        SampleError: the folder holds no adapter.
        RuntimeError: an engine did not load it (its answer is in the message); the caller fails
            the future, and the SDK may retry the save.
    """
    folder = sampler_folder(model.run_id, name)
    if not (folder / WEIGHTS).is_file():
        raise SampleError(f"sampler {name!r} of {model.id}: no adapter was written at {folder}")
    served = adapter_name(run_label(model.run_id), folder)
    urls = engine_urls or get_settings().engine_urls
    results = push_adapter(urls, folder, served, 0)
    failed = {url: r for url, r in results.items() if r != "ok"}
    if failed:
        raise RuntimeError(f"engines did not load sampler {name!r} ({served}): {failed}")
    path = sampler_path(model.id, name)
    session_id = session_id or model.session_id
    if sampling_seq_id is None:
        return {"path": path, "type": "save_weights_for_sampler"}
    # A save re-run after its worker died finds the session its first run made (unique per SDK session and seq).
    row = s.scalars(select(TinkerSamplingSession).where(TinkerSamplingSession.session_id == session_id,
                                                        TinkerSamplingSession.seq_id == int(sampling_seq_id))).first()
    if row is None:
        row = TinkerSamplingSession(id=f"sampler-{uuid.uuid4()}", session_id=session_id, seq_id=int(sampling_seq_id),
                                    key_name=model.key_name, base_model=model.base_model, model_id=model.id,
                                    model_path=path)
        s.add(row)
        s.flush()
    return {"sampling_session_id": row.id, "path": None, "type": "save_weights_for_sampler"}


@dataclass(frozen=True)
class SamplerTarget:
    """What a sample request runs on: the engines' `base_model`, under the adapter `adapter`
    (served name) read from `folder`, or on the base model alone (both None)."""

    base_model: str
    adapter: str | None = None
    folder: Path | None = None
    run_id: int | None = None


def resolve(s: Session, future: TinkerFuture) -> SamplerTarget:
    """The sampler of sample future `future`, checked against the key that sent it.

    Raises `SampleError` ("no ... for this key") for a sampling session, model or checkpoint that
    is missing or belongs to another key, and for a checkpoint path of another model.
    """
    payload = future.payload or {}
    key = future.key_name
    model_path, base_model = payload.get("model_path"), payload.get("base_model")
    if future.sampling_session_id:
        sampler = s.get(TinkerSamplingSession, future.sampling_session_id)
        if sampler is None or sampler.key_name != key:
            raise SampleError(f"no sampling session {future.sampling_session_id!r} for this key")
        model_path, base_model = sampler.model_path, sampler.base_model
    if not model_path:
        if not base_model:
            raise SampleError("a sample request needs a sampling session, a model_path or a base_model")
        return SamplerTarget(base_model)
    model_id, name = parse_sampler_path(model_path)
    model = s.get(TinkerModel, model_id)
    if model is None or model.key_name != key:
        raise SampleError(f"no model {model_id!r} for this key")
    folder = sampler_folder(model.run_id, name)
    if not (folder / WEIGHTS).is_file():
        raise SampleError(f"no sampler checkpoint {model_path!r} for this key (save_weights_for_sampler first)")
    return SamplerTarget(model.base_model, adapter_name(run_label(model.run_id), folder), folder, model.run_id)


def pick_engine(key: str, urls: list[str] | None = None) -> str:
    """The engine that answers sampling session `key`: rendezvous hashing as the gateway's
    sessions, so one session's prompts meet the prefix cache that holds them."""
    urls = [u.rstrip("/") for u in (urls or get_settings().engine_urls)]
    return max(urls, key=lambda u: hashlib.blake2b(key.encode() + u.encode(), digest_size=8).digest())
