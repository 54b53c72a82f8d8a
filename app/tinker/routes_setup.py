"""The Tinker routes a client calls before and around its ops: client config, sessions and
heartbeats, capabilities, create_model / get_info, sampling sessions (create, get), telemetry.

Shapes are the SDK's own types (tinker/types/*.py); each route names the SDK call that sends it.
"""
from __future__ import annotations

import uuid

from flask import Blueprint, g, jsonify, request
from tinker import types

from app.control import tinker_futures
from app.db import session_scope
from app.tinker import registry
from app.tinker.http import TinkerError, authed, check_version, idempotency_key, json_body

bp = Blueprint("tinker_setup", __name__)

MAX_CONTEXT = 2048  # tokens: the trainer's sequence cap for Tinker batches (SmolLM2's context is 8192)


@bp.get("/api/v1/healthz")
def healthz():
    """`ServiceClient` health check: no key needed."""
    return jsonify({"status": "ok"})


@bp.post("/api/v1/client/config")
@authed
def client_config():
    """Feature flags the SDK reads once per client (`ClientConfigResponse`): API keys only (no JWT),
    httpx's transport, zstd-compressed forward_backward bodies, per-request retrieve_future polling,
    custom losses computed client-side (the SDK's forward + linearised forward_backward)."""
    body = json_body(types.ClientConfigRequest)
    check_version(body.sdk_version)
    return jsonify(types.ClientConfigResponse(
        pjwt_auth_enabled=False, use_pyqwest_transport=False, proto_compress_fwdbwd=True,
        sample_use_retrieve_futures=False, custom_loss_server_side=False, sample_join_sampling_session=False,
        parallel_fwdbwd_chunks=False).model_dump(mode="json"))


@bp.post("/api/v1/client/dynamic_config")
@authed
def client_dynamic_config():
    """Flags the SDK re-reads every `refresh_interval_sec`: no server-side sample cancel."""
    json_body(types.ClientConfigRequest)
    return jsonify(types.ClientDynamicConfigResponse(sample_cancel_enabled=False).model_dump(mode="json"))


@bp.post("/api/v1/telemetry")
@authed
def telemetry():
    """The SDK's telemetry batches: accepted and dropped (Turnstile keeps its own logs)."""
    return jsonify({"status": "accepted"})


@bp.get("/api/v1/get_server_capabilities")
@authed
def capabilities():
    """`ServiceClient.get_server_capabilities()`: the base models the trainer can hold."""
    models = [types.SupportedModel(model_name=name, max_context_length=MAX_CONTEXT, trainable=True, sampleable=True)
              for name in registry.served_names()]
    return jsonify(types.GetServerCapabilitiesResponse(supported_models=models).model_dump(mode="json"))


@bp.post("/api/v1/create_session")
@authed
def create_session():
    """`ServiceClient(...)`: a session of the caller's key (`CreateSessionResponse`)."""
    body = json_body(types.CreateSessionRequest)
    check_version(body.sdk_version)
    with session_scope() as s:
        row = registry.create_session(s, g.key_name, sdk_version=body.sdk_version, tags=body.tags,
                                      user_metadata=body.user_metadata)
        session_id = row.id
    return jsonify(types.CreateSessionResponse(session_id=session_id).model_dump(mode="json"))


@bp.post("/api/v1/session_heartbeat")
@authed
def session_heartbeat():
    """The SDK's heartbeat, every 10 s."""
    body = json_body(types.SessionHeartbeatRequest)
    with session_scope() as s:
        registry.heartbeat(s, g.key_name, body.session_id)
    return jsonify(types.SessionHeartbeatResponse().model_dump(mode="json"))


@bp.post("/api/v1/sessions/<session_id>/finish")
@authed
def finish_session(session_id: str):
    """`ServiceClient.close()` (and leaving its `with` block): body `{"reason": {"type": "success" |
    "errored" | "interrupted"}, "detail": str | null}`, answered with an empty 200 (the SDK
    casts the reply to None)."""
    body = json_body()
    reason = body.get("reason")
    if not isinstance(reason, dict) or not isinstance(reason.get("type"), str):
        raise TinkerError(400, 'finish needs a JSON body {"reason": {"type": "success" | "errored" | "interrupted"}, '
                               '"detail": ...}')
    detail = body.get("detail")
    with session_scope() as s:
        registry.finish_session(s, g.key_name, session_id, reason=reason["type"],
                                detail=str(detail)[:2000] if detail is not None else None)
    return "", 200


@bp.post("/api/v1/create_model")
@authed
def create_model():
    """`create_lora_training_client(base_model, rank)`: a run of kind `tinker` and its model; the
    future it returns is complete at once (`CreateModelResponse`)."""
    body = json_body(types.CreateModelRequest)
    lora = body.lora_config
    optimizer = getattr(body.optimizer_config, "type", "adamw")
    if optimizer != "adamw":
        raise TinkerError(400, f"optimizer {optimizer!r} is not supported here: AdamW only (AdamOptimizerConfig)")
    with session_scope() as s:
        model = registry.create_model(
            s, g.key_name, session_id=body.session_id, seq_id=body.model_seq_id, base_model=body.base_model,
            rank=lora.rank if lora else None, seed=lora.seed if lora else None, user_metadata=body.user_metadata,
            train_attn=lora.train_attn if lora else True, train_mlp=lora.train_mlp if lora else True,
            train_unembed=lora.train_unembed if lora else True)
        future = tinker_futures.create(s, model_id=model.id, request_id=idempotency_key() or str(uuid.uuid4()),
                                       op="create_model", payload=body.model_dump(mode="json"), key_name=g.key_name)
        tinker_futures.complete(s, future.id, types.CreateModelResponse(model_id=model.id).model_dump(mode="json"))
        out = {"request_id": future.request_id, "model_id": model.id}
    return jsonify(out)


@bp.post("/api/v1/get_info")
@authed
def get_info():
    """`TrainingClient.get_info()` (and every TrainingClient's construction): the base model, the
    LoRA rank and the tokenizer's folder (SmolLM2's tokenizer, which the tiny model shares)."""
    body = json_body(types.GetInfoRequest)
    with session_scope() as s:
        model = registry.model_of(s, g.key_name, body.model_id)
        base, rank, model_id = model.base_model, model.lora_rank, model.id
    info = types.GetInfoResponse(type="get_info", model_id=model_id, is_lora=True, lora_rank=rank, model_name=base,
                                 model_data=types.ModelData(arch="llama", model_name=base,
                                                            tokenizer_id=tokenizer_folder()))
    return jsonify(info.model_dump(mode="json"))


def tokenizer_folder() -> str:
    """The SmolLM2 tokenizer's folder (written on first use): what `get_tokenizer()` loads offline."""
    from app.engines import modeling

    modeling.load_tokenizer()
    return str(modeling.models_dir() / modeling.TOKENIZER_DIR)


@bp.post("/api/v1/create_sampling_session")
@authed
def create_sampling_session():
    """`create_sampling_client(model_path=... | base_model=...)`."""
    body = json_body(types.CreateSamplingSessionRequest)
    with session_scope() as s:
        row = registry.create_sampling_session(s, g.key_name, session_id=body.session_id,
                                               seq_id=body.sampling_session_seq_id, base_model=body.base_model,
                                               model_path=body.model_path)
        out = {"sampling_session_id": row.id}
    return jsonify(types.CreateSamplingSessionResponse(**out).model_dump(mode="json"))


@bp.get("/api/v1/samplers/<sampler_id>")
@authed
def get_sampler(sampler_id: str):
    """`create_sampling_client(model_path=...)` without a base model (and `SamplingClient`'s
    `_get_sampler_submit`): the sampling session's base model and checkpoint path; another key's
    session is a 404 like a missing one."""
    with session_scope() as s:
        row = registry.sampling_session_of(s, g.key_name, sampler_id)
        out = types.GetSamplerResponse(sampler_id=row.id, base_model=row.base_model, model_path=row.model_path)
    return jsonify(out.model_dump(mode="json"))


@bp.route("/api/v1/<path:rest>", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
@authed
def unsupported(rest: str):
    """Every other Tinker route (the REST client's training_runs, checkpoints, weights_info, ...):
    a 404 that names the route, so the SDK raises NotFoundError instead of waiting."""
    raise TinkerError(404, f"{request.method} /api/v1/{rest} is not supported by this Turnstile Tinker server "
                           "(docs/tinker.md lists the supported routes)")
