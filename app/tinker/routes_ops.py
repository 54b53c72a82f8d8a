"""The Tinker ops and their futures: each op is a `tinker_futures` row sent to its Celery task,
and `retrieve_future` answers the SDK's polling from that row.

Ops (route -> stored op -> queue):
    forward_backward (protobuf, forward_only)  -> forward | forward_backward -> gpu
    optim_step / save_weights / load_weights / save_weights_for_sampler    -> gpu
    asample                                    -> sample                    -> rollout
The future's `payload` is the request's JSON (`forward_backward`: the ForwardBackwardInput only,
the op says whether it is forward-only).  A request is answered with `UntypedAPIFuture`
{"request_id", "model_id"} once its row is committed and its message sent; the SDK's retry of
the same request (same `X-Idempotency-Key`) gets the same row and sends nothing again.  A message
that cannot be sent fails its future at once (the SDK raises instead of polling for ever).

retrieve_future (tinker/lib/api_future_impl.py): pending or running -> `{"type": "try_again"}`
after waiting up to `POLL_WAIT_S` for it to finish (the SDK polls again at once on try_again, so
the wait keeps it from spinning); failed -> `{"error", "category"}` (the SDK raises
RequestFailedError); completed -> the result: protobuf for forward/forward_backward and sample
(the SDK asks for it with `Accept: application/x-protobuf` and refuses JSON for them), JSON
otherwise.
"""
from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from flask import Blueprint, Response, g, jsonify, request
from sqlalchemy import select
from tinker import types

from app.control import tinker_futures
from app.db import session_scope
from app.tables import TinkerFuture
from app.tinker import registry, wire
from app.tinker.http import TinkerError, authed, idempotency_key, json_body, max_body_bytes

bp = Blueprint("tinker_ops", __name__)

POLL_WAIT_S = 2.0    # longest wait inside one retrieve_future before try_again
POLL_EVERY_S = 0.05  # SQL re-read interval during that wait
# Losses the trainer computes (app.training.tinker_ops); the SDK's custom losses arrive as
# cross_entropy with per-token weights (client-side custom loss, custom_loss_server_side off).
LOSSES = ("cross_entropy", "importance_sampling", "ppo")
# kombu's Redis transport dropped messages published from several threads of one process
# (workers/api_conf.py): one publisher at a time per process.
_SEND_LOCK = threading.Lock()


def _send(future_id: int, op: str) -> None:
    from app.tasks.send import send_tinker_future

    with _SEND_LOCK:
        send_tinker_future(future_id, op)


def submit(op: str, *, model_id: str | None, payload: dict[str, Any], seq_id: int | None = None,
           sampling_session_id: str | None = None, extra: dict[str, Any] | None = None) -> Response:
    """Create (or find, for a retry) the future of this request and send it to its worker;
    answer `UntypedAPIFuture`.  404 for another key's model, 429 over the key's in-flight quota."""
    request_id = idempotency_key() or str(uuid.uuid4())
    with session_scope() as s:
        if model_id is not None:
            registry.model_of(s, g.key_name, model_id, active=op != "sample")
        new = tinker_futures.get(s, request_id) is None
        if new:
            registry.check_inflight(s, g.key_name)
        try:
            row = tinker_futures.create(s, model_id=model_id, request_id=request_id, op=op, payload=payload,
                                        key_name=g.key_name, sampling_session_id=sampling_session_id, seq_id=seq_id)
        except tinker_futures.FutureConflict as exc:
            raise TinkerError(400, str(exc)) from None  # not 409: the SDK retries a 409
        future_id, status = row.id, row.status
    if new and status == "pending":
        try:
            _send(future_id, op)
        except Exception as exc:  # noqa: BLE001 - any broker failure: the future must not wait for ever
            with session_scope() as s:
                tinker_futures.fail(s, future_id, {"error": f"could not queue this {op}: {type(exc).__name__}: "
                                                            f"{exc}. Is Redis up?", "category": tinker_futures.SERVER})
    return jsonify({"request_id": request_id, "model_id": model_id, **(extra or {})})


def _check_loss(loss_fn: str) -> None:
    if loss_fn not in LOSSES:
        raise TinkerError(400, f"loss function {loss_fn!r} is not supported here; supported: {', '.join(LOSSES)} "
                               "(and forward_backward_custom, which the SDK runs as cross_entropy with weights)")


@bp.post("/api/v1/forward_backward")
@authed
def forward_backward():
    """`TrainingClient.forward_backward` / `forward`: a protobuf ForwardBackwardRequest (zstd or
    not); a JSON body (older SDKs) is read as the ForwardBackwardRequest JSON."""
    if request.mimetype == wire.PROTO_CONTENT_TYPE:
        try:
            body = wire.decompress(request.get_data(), request.headers.get("Content-Encoding"), max_body_bytes())
            fields, payload = wire.decode_forward_backward(body)
        except wire.WireError as exc:
            raise TinkerError(400, str(exc)) from None
        forward_only = fields["forward_only"]
    else:
        req = json_body()
        fields = {"model_id": str(req.get("model_id") or ""), "seq_id": req.get("seq_id")}
        try:
            payload = wire.validate_input(req.get("forward_backward_input"))
        except wire.WireError as exc:
            raise TinkerError(400, str(exc)) from None
        forward_only = bool(req.get("forward_only", False))
    if not fields["model_id"]:
        raise TinkerError(400, "forward_backward: model_id is empty")
    _check_loss(payload["loss_fn"])
    if not payload["data"]:
        raise TinkerError(400, "forward_backward: no data")
    return submit("forward" if forward_only else "forward_backward", model_id=fields["model_id"], payload=payload,
                  seq_id=fields["seq_id"])


@bp.post("/api/v1/optim_step")
@authed
def optim_step():
    """`TrainingClient.optim_step(AdamParams(...))`."""
    body = json_body(types.OptimStepRequest)
    return submit("optim_step", model_id=body.model_id, payload=body.model_dump(mode="json"), seq_id=body.seq_id)


@bp.post("/api/v1/save_weights")
@authed
def save_weights():
    """`TrainingClient.save_state(name)`."""
    body = json_body(types.SaveWeightsRequest)
    return submit("save_weights", model_id=body.model_id, payload=body.model_dump(mode="json"), seq_id=body.seq_id)


@bp.post("/api/v1/load_weights")
@authed
def load_weights():
    """`TrainingClient.load_state(path)` / `load_state_with_optimizer(path)`: a path of this key's models."""
    body = json_body(types.LoadWeightsRequest)
    if not body.model_id:
        raise TinkerError(400, "load_weights without model_id (create_training_client_from_state) is not supported "
                               "here: create a LoRA training client, then load_state(path)")
    with session_scope() as s:
        registry.model_of(s, g.key_name, registry.parse_model_path(body.path))  # the source is the key's too
    return submit("load_weights", model_id=body.model_id, payload=body.model_dump(mode="json"), seq_id=body.seq_id)


@bp.post("/api/v1/save_weights_for_sampler")
@authed
def save_weights_for_sampler():
    """`TrainingClient.save_weights_for_sampler(name)`: a named adapter version the engines load."""
    body = json_body(types.SaveWeightsForSamplerRequest)
    return submit("save_weights_for_sampler", model_id=body.model_id, payload=body.model_dump(mode="json"),
                  seq_id=body.seq_id)


@bp.post("/api/v1/asample")
@authed
def asample():
    """`SamplingClient.sample(...)`: on the sampling session's base model or sampler checkpoint."""
    body = json_body(types.SampleRequest)
    model_id = None
    with session_scope() as s:
        if body.sampling_session_id:
            sampler = registry.sampling_session_of(s, g.key_name, body.sampling_session_id, open_only=True)
            model_id = sampler.model_id
        elif body.model_path:
            model_id = registry.model_of(s, g.key_name, registry.parse_model_path(body.model_path)).id
        elif body.base_model is not None:
            body = body.model_copy(update={"base_model": registry.base_model_spec(body.base_model)})
    if body.num_samples < 1:
        raise TinkerError(400, f"num_samples must be at least 1, got {body.num_samples}")
    request_id = idempotency_key() or str(uuid.uuid4())
    ids = [f"{request_id}:{i}" for i in range(body.num_samples)]
    return submit("sample", model_id=model_id, payload=body.model_dump(mode="json"), seq_id=body.seq_id,
                  sampling_session_id=body.sampling_session_id, extra={"sample_sequence_ids": ids})


@bp.post("/api/v1/retrieve_future")
@authed
def retrieve_future():
    """The SDK's poll of one future (module docstring)."""
    body = json_body(types.FutureRetrieveRequest)
    deadline = time.monotonic() + POLL_WAIT_S
    while True:
        with session_scope() as s:
            row = tinker_futures.get(s, body.request_id, key_name=g.key_name)
            if row is None:
                raise TinkerError(404, f"no request {body.request_id!r} for this key")
            status, op, result, error = row.status, row.op, row.result, row.error
        if status in ("completed", "failed") or time.monotonic() >= deadline:
            break
        time.sleep(POLL_EVERY_S)
    if status == "failed":
        return jsonify({"error": (error or {}).get("error", "failed"),
                        "category": (error or {}).get("category", tinker_futures.SERVER)})
    if status != "completed":
        return jsonify({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
    return _result_response(op, result or {})


def _result_response(op: str, result: dict[str, Any]) -> Response:
    try:
        if op in ("forward", "forward_backward"):
            return Response(wire.encode_forward_backward_output(result), mimetype=wire.PROTO_CONTENT_TYPE)
        if op == "sample":
            return Response(wire.encode_sample_response(result), mimetype=wire.PROTO_CONTENT_TYPE)
    except (wire.WireError, KeyError, TypeError, ValueError) as exc:
        return jsonify({"error": f"the stored {op} result cannot be encoded: {exc}", "category": "Server"})
    return jsonify(result)


@bp.post("/api/v1/retrieve_futures")
@authed
def retrieve_futures():
    """A sampling session's finished requests (`FuturesRetrieveResponse`), for SDKs that poll per
    session (`sample_use_retrieve_futures`; off in this server's client config).  Finished requests
    the SDK has not yet listed in `retrieved_request_ids` are reported (again) on each poll."""
    body = json_body(types.FuturesRetrieveRequest)
    with session_scope() as s:
        registry.sampling_session_of(s, g.key_name, body.target.sampling_session_id)
        rows = s.execute(select(TinkerFuture.id, TinkerFuture.request_id, TinkerFuture.status).where(
            TinkerFuture.sampling_session_id == body.target.sampling_session_id,
            TinkerFuture.status.in_(("completed", "failed"))).order_by(TinkerFuture.id)).all()
    seen = set(body.retrieved_request_ids)
    completions = [{"state": "finished" if status == "completed" else "failed", "request_id": rid}
                   for _, rid, status in rows if rid not in seen]
    return jsonify({"completions": completions, "cursor": rows[-1][0] if rows else body.prev_cursor})


@bp.post("/api/v1/cancel_future")
@authed
def cancel_future():
    """An abandoned sampling request: failed if it has not finished."""
    body = json_body()
    with session_scope() as s:
        row = tinker_futures.get(s, str(body.get("request_id", "")), key_name=g.key_name)
        if row is None:
            raise TinkerError(404, f"no request {body.get('request_id')!r} for this key")
        tinker_futures.fail(s, row.id, {"error": "cancelled by the client", "category": tinker_futures.USER})
    return jsonify({})
