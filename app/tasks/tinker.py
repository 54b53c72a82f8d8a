"""`gpu` queue: the Tinker SDK's training ops, one `tinker_futures` row each (`run_future`).

The service (app.tinker) writes the future and sends `run_future(future_id)`; this task claims it
(compare-and-set `pending -> running` under a lease it renews while it works), runs the op on
the model's LoRA tenant (`app.training.tinker_ops`), and completes or fails the row.

Exactly once, with a kill -9 anywhere:
* acks_late + reject_on_worker_lost: a message whose worker died is delivered again; the claim
  lets it run only when the row is still pending, or running under an expired lease (once:
  `tinker_futures.MAX_ATTEMPTS`), so a finished op never runs again and no op runs twice at once.
* Ops of one model run in their futures' order (the order the SDK sent them): a future whose
  predecessor of the same model is unfinished is retried shortly, not run.
* Persisted state (`<run dir>/tinker/current.pt`): after every optim_step and load_weights the
  tenant's adapter, AdamW state, step count and `applied_through` (that future's id) are written
  before the future completes.  A worker that does not hold the tenant (a restart, another
  model's shape swapped in) loads that file, then REPLAYS the forward_backward futures completed
  since `applied_through` (their stored payloads, in order): the gradients accumulated before
  the kill are recomputed, bit-equal on the same device, never lost and never added twice.  An
  optim_step killed after its state was written finds `applied_through` equal to its own id
  and completes with the stored result instead of stepping again.
torch and the SDK are imported inside the task body, in the prefork child (workers/gpu_worker.py).
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from celery import shared_task
from sqlalchemy import select

from app.control import tinker_futures, trainer_shares
from app.db import session_scope
from app.paths import RunPaths
from app.runconfig import RunConfig
from app.tables import Run, TinkerFuture, TinkerModel

log = logging.getLogger(__name__)

GPU_OPS = ("forward", "forward_backward", "optim_step", "save_weights", "load_weights", "save_weights_for_sampler")
STATE_FILE = "current.pt"
WEIGHTS_KIND = "weights"  # tinker://<model id>/weights/<name>: save_state / load_state paths
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ORDER_RETRY_S = 0.2


def lease_s() -> float:
    """Seconds a claim holds a future without renewal (renewed every third of it while the op
    runs): `TURNSTILE_TINKER_LEASE_S`, default 60."""
    return float(os.environ.get("TURNSTILE_TINKER_LEASE_S", "60"))


class UserError(ValueError):
    """An op the caller got wrong (bad path, name, inputs): failed with category User."""


@shared_task(name="app.tasks.tinker.run_future", bind=True, acks_late=True, reject_on_worker_lost=True,
             ignore_result=True, max_retries=None)
def run_future(self, future_id: int, yields: int = 0) -> str:
    """Run Tinker future `future_id` once; returns its status after this call ("completed",
    "failed", or "skipped" when another claim has it or it was already finished).  `yields`: how
    often it has let a run with less trainer time per share go first (app.control.trainer_shares)."""
    with session_scope() as s:
        row = s.get(TinkerFuture, future_id)
        if row is None or row.status not in ("pending", "running"):
            return "skipped"
        if _predecessor_unfinished(s, row):
            raise self.retry(countdown=ORDER_RETRY_S, kwargs={"yields": yields})
        model = s.get(TinkerModel, row.model_id) if row.model_id is not None else None
        run_id = model.run_id if model is not None else None
        if (run_id is not None and row.status == "pending" and yields < trainer_shares.MAX_YIELDS
                and trainer_shares.should_yield(s, run_id)):
            raise self.retry(countdown=trainer_shares.YIELD_S, kwargs={"yields": yields + 1})
        claimed = tinker_futures.claim(s, future_id, lease_s=lease_s())
        if claimed is None:
            again = s.get(TinkerFuture, future_id, populate_existing=True)
            if again is not None and again.status == "running" and again.attempts < tinker_futures.MAX_ATTEMPTS:
                # Running under a live lease: its worker may be the one that just died (a message
                # redelivered at once on restart); look again once that lease can have expired.
                raise self.retry(countdown=lease_s() / 2)
            return "skipped"
        op, payload, attempt, model_id = claimed.op, dict(claimed.payload), claimed.attempts, claimed.model_id
    stop = _renew_lease(future_id, attempt)
    start = time.perf_counter()
    try:
        result = execute(future_id, op, model_id, payload)
        log.info("tinker future %s (%s): %.3f s on the trainer", future_id, op, time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - every failure ends the future, with its category
        from app.training.tinker_ops import LossInputError, drop

        user = isinstance(exc, (UserError, LossInputError, FileNotFoundError))
        if not user and model_id is not None:
            try:
                drop(_run_id(model_id))  # its tenant may be half-updated: restored from disk next time
            except UserError:
                pass
        log.warning("tinker future %s (%s) failed: %s: %s", future_id, op, type(exc).__name__, exc)
        message = str(exc) if user else f"{op} failed on the trainer: {type(exc).__name__}: {exc}"
        with session_scope() as s:
            tinker_futures.fail(s, future_id, {"error": message[:4000], "category":
                                               tinker_futures.USER if user else tinker_futures.SERVER}, attempt=attempt)
        return "failed"
    finally:
        stop.set()
        if run_id is not None:
            trainer_shares.record(run_id, time.perf_counter() - start)
    with session_scope() as s:
        if not tinker_futures.complete(s, future_id, result, attempt=attempt):
            log.warning("tinker future %s: its lease was taken over before it completed", future_id)
    return "completed"


def _predecessor_unfinished(s, row: TinkerFuture) -> bool:
    """Whether an earlier gpu op of the same model is still pending or running."""
    if row.model_id is None:
        return False
    return s.scalar(select(TinkerFuture.id).where(
        TinkerFuture.model_id == row.model_id, TinkerFuture.id < row.id, TinkerFuture.op.in_(GPU_OPS),
        TinkerFuture.status.in_(("pending", "running"))).limit(1)) is not None


def _renew_lease(future_id: int, attempt: int) -> threading.Event:
    """A daemon thread renewing the claim every third of the lease until the returned event is set."""
    stop = threading.Event()
    period = lease_s() / 3

    def loop() -> None:
        while not stop.wait(period):
            try:
                with session_scope() as s:
                    if not tinker_futures.renew(s, future_id, attempt=attempt, lease_s=lease_s()):
                        return
            except Exception as exc:  # noqa: BLE001 - a missed renewal only risks a re-claim
                log.warning("tinker future %s: lease renewal failed: %s", future_id, exc)

    threading.Thread(target=loop, name=f"tinker-lease-{future_id}", daemon=True).start()
    return stop


def _run_id(model_id: str) -> int:
    with session_scope() as s:
        model = s.get(TinkerModel, model_id)
        if model is None:
            raise UserError(f"model {model_id!r} does not exist")
        return model.run_id


def _model(model_id: str) -> tuple[int, str, Any]:
    """(run id, base model spec, TrainingConfig) of Tinker model `model_id`."""
    with session_scope() as s:
        model = s.get(TinkerModel, model_id)
        run = s.get(Run, model.run_id) if model is not None else None
        if run is None:
            raise UserError(f"model {model_id!r} does not exist")
        cfg = RunConfig.model_validate(run.config)
        return run.id, cfg.model.name, cfg.training


def state_path(run_id: int) -> Path:
    """The persisted state of run `run_id`'s tenant (module docstring)."""
    return RunPaths(run_id).root / "tinker" / STATE_FILE


def weights_path(run_id: int, name: str) -> Path:
    """The file of save_state checkpoint `name` of run `run_id`."""
    return RunPaths(run_id).root / "tinker" / WEIGHTS_KIND / f"{check_name(name)}.pt"


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise UserError(f"checkpoint name {name!r}: use 1-128 letters, digits, '.', '_' or '-' (no '/', no '..')")
    return name


def parse_weights_path(path: str) -> tuple[str, str]:
    """(model id, name) of `tinker://<model id>/weights/<name>`; `UserError` otherwise."""
    parts = path[len("tinker://"):].split("/") if isinstance(path, str) and path.startswith("tinker://") else []
    if len(parts) != 3 or not parts[0] or parts[1] != WEIGHTS_KIND:
        raise UserError(f"{path!r} is not a tinker://<model id>/{WEIGHTS_KIND}/<name> path (save_state's)")
    return parts[0], check_name(parts[2])


def _tenant(future_id: int, model_id: str):
    """(pool, state, run id): the model's tenant, restored and replayed unless the resident one
    holds exactly what SQL says it should: the state after the last completed optim_step /
    load_weights, plus the gradients of the forward_backward futures completed since (another
    gpu worker may have run some of them)."""
    from app.training import tinker_ops

    run_id, spec, training = _model(model_id)
    pool, state, fresh = tinker_ops.tenant(run_id, spec, training)
    applied, since = _expected(model_id, future_id, state.applied_through if fresh else None)
    if not fresh and (state.applied_through != applied or state.grad_futures != [i for i, _ in since]):
        tinker_ops.drop(run_id)  # stale: the model moved on elsewhere
        pool, state, fresh = tinker_ops.tenant(run_id, spec, training)
    if fresh:
        path = state_path(run_id)
        if path.is_file():
            state.applied_through = int(tinker_ops.load_state(pool, state, path).get("applied_through", 0))
        _, since = _expected(model_id, future_id, state.applied_through)
        for replayed_id, payload in since:
            tinker_ops.forward_backward(pool, state, payload)
            state.grad_futures.append(replayed_id)
        if since:
            log.info("tinker model %s: replayed %d forward_backward futures after restoring its state",
                     model_id, len(since))
    return pool, state, run_id


def _expected(model_id: str, future_id: int, after: int | None) -> tuple[int, list[tuple[int, dict]]]:
    """(id of the last completed optim_step / load_weights before `future_id`, 0 if none;
    [(id, payload)] of the forward_backward futures completed after it, or after `after` when
    given, and before `future_id`, in order)."""
    with session_scope() as s:
        applied = s.scalar(select(TinkerFuture.id).where(
            TinkerFuture.model_id == model_id, TinkerFuture.op.in_(("optim_step", "load_weights")),
            TinkerFuture.status == "completed", TinkerFuture.id < future_id)
            .order_by(TinkerFuture.id.desc()).limit(1)) or 0
        since = s.execute(select(TinkerFuture.id, TinkerFuture.payload).where(
            TinkerFuture.model_id == model_id, TinkerFuture.op == "forward_backward",
            TinkerFuture.status == "completed", TinkerFuture.id > (applied if after is None else after),
            TinkerFuture.id < future_id).order_by(TinkerFuture.id)).all()
    return applied, [(i, p) for i, p in since]


def _persist(pool, state, run_id: int, future_id: int, result: dict) -> None:
    from app.training import tinker_ops

    state.applied_through = future_id
    tinker_ops.save_state(pool, state, state_path(run_id), {"applied_through": future_id, "result": result})


def execute(future_id: int, op: str, model_id: str | None, payload: dict[str, Any]) -> dict:
    """Run gpu op `op` of future `future_id` on model `model_id`'s tenant; return the SDK response
    JSON.  Raises `UserError` / `LossInputError` / FileNotFoundError for the caller's mistakes."""
    from app.training import tinker_ops

    if op not in GPU_OPS:
        raise UserError(f"op {op!r} is not a trainer op ({', '.join(GPU_OPS)})")
    if model_id is None:
        raise UserError(f"{op} needs a model_id")
    pool, state, run_id = _tenant(future_id, model_id)
    if op in ("forward", "forward_backward"):
        result = tinker_ops.forward_backward(pool, state, payload, backward=op == "forward_backward")
        if op == "forward_backward":
            state.grad_futures.append(future_id)
        _test_delay(op)
        return result
    if op == "optim_step":
        if state.applied_through == future_id:  # applied and persisted before its worker died
            return tinker_ops.load_state(pool, state, state_path(run_id)).get("result") or {}
        result = tinker_ops.optim_step(pool, state, payload)
        _persist(pool, state, run_id, future_id, result)
        return result
    if op == "save_weights":
        name = payload.get("path") or f"step-{state.optim_steps:06d}"
        path = weights_path(run_id, name)
        if path.exists() and not payload.get("overwrite"):
            raise UserError(f"checkpoint {name!r} of {model_id} exists; save under another name or with overwrite")
        tinker_ops.save_state(pool, state, path, {"model_id": model_id, "name": name})
        return {"path": f"tinker://{model_id}/{WEIGHTS_KIND}/{name}", "type": "save_weights"}
    if op == "load_weights":
        source, name = parse_weights_path(payload.get("path"))
        tinker_ops.load_state(pool, state, weights_path(_run_id(source), name), optimizer=bool(payload.get("optimizer")))
        result = {"path": payload["path"], "model_id": model_id, "type": "load_weights"}
        _persist(pool, state, run_id, future_id, result)
        return result
    return _save_for_sampler(pool, state, run_id, model_id, payload)


def _save_for_sampler(pool, state, run_id: int, model_id: str, payload: dict[str, Any]) -> dict:
    """save_weights_for_sampler: the adapter in the engines' format under the sampler checkpoint's
    folder, then served by every engine (`app.control.tinker_samplers.publish`)."""
    from app.control import tinker_samplers
    from app.training import tinker_ops

    seq = payload.get("sampling_session_seq_id")
    with session_scope() as s:
        session_id = s.get(TinkerModel, model_id).session_id
    # Unnamed: a name fixed by (session, sampling seq id), so a save re-run after its worker died
    # rewrites the same folder and publishes the same sampling session, not a second one.
    name = payload.get("path") or tinker_samplers.ephemeral_name(session_id, seq)
    try:
        folder = tinker_samplers.sampler_folder(run_id, name)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    tinker_ops.save_engine_adapter(pool, state, folder)
    with session_scope() as s:
        return tinker_samplers.publish(s, s.get(TinkerModel, model_id), name, session_id=session_id,
                                       sampling_seq_id=None if payload.get("path") else seq)


def _test_delay(op: str) -> None:
    """Tests only: sleep `TURNSTILE_TINKER_TEST_DELAY_S` after a forward_backward's gradients are
    computed and before it completes, so a test can kill the worker mid-op."""
    delay = float(os.environ.get("TURNSTILE_TINKER_TEST_DELAY_S") or 0)
    if delay > 0 and op == "forward_backward":
        log.warning("tinker test delay: sleeping %.1f s before completing", delay)
        time.sleep(delay)
