"""Sessions, models and sampling sessions of the Tinker service, each owned by one API key.

A Tinker model is a LoRA tenant of the trainer: `create_model` writes a `runs` row of kind
`tinker` (its config a `RunConfig` with `training.lora`, the base model as `model.name`, the LoRA
rank as `training.lora_r`, the SDK's seed as `training.seed`) and the `tinker_models` row that names
it for the SDK (`tinker-<run id>`).  The trainer builds the tenant from that run's config on its
first op (app.training.tenants).  Every lookup takes the caller's key name and treats another
key's object as missing (404), so a tenant cannot tell another's model from one that does not exist.
Quotas (`TURNSTILE_TINKER_KEYS`): models not finished, live sessions, futures in flight.
"""
from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.config import get_settings
from app.control import tinker_models, trainer_shares
from app.control.runs import claim_run_dir
from app.runconfig import RunConfig
from app.tables import Run, TinkerFuture, TinkerModel, TinkerSamplingSession, TinkerSession, utcnow
from app.tinker.http import TinkerError

ACTIVE_RUN_STATES = ("queued", "running", "cancelling")
# Hugging Face ids of the built-in model specs: what a Tinker user names a base model by (Tinker's
# own model lineup uses Hub ids, and tinker-cookbook loads the tokenizer by the same name).
HUB_IDS = {"HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2"}


def served_names() -> list[str]:
    """Every base model name the service answers to: the specs in `tinker_base_models`, then the
    Hub ids (`HUB_IDS`) of those among them."""
    specs = get_settings().tinker_base_models
    return [*specs, *(hub for hub, spec in HUB_IDS.items() if spec in specs)]


def base_model_spec(name: str | None) -> str:
    """The model spec the trainer and engines load for base model `name` (a spec of
    `tinker_base_models` or its Hub id); 400 naming the supported names otherwise."""
    spec = HUB_IDS.get(name, name) if isinstance(name, str) else None
    if spec not in get_settings().tinker_base_models:
        raise TinkerError(400, f"base model {name!r} is not served here; supported: "
                               f"{', '.join(served_names())} (ServiceClient.get_server_capabilities)")
    return spec


def _quota(key_name: str):
    return get_settings().tinker_keys[key_name]


def create_session(s: Session, key_name: str, *, sdk_version: str, tags: list[str],
                   user_metadata: dict[str, Any] | None) -> TinkerSession:
    """A new session of `key_name`.  403 when the key already has `max_sessions` live sessions
    (not finished, a heartbeat within `TURNSTILE_TINKER_SESSION_TIMEOUT_S`)."""
    since = utcnow() - dt.timedelta(seconds=get_settings().tinker_session_timeout_s)
    live = s.scalar(select(func.count()).select_from(TinkerSession)
                    .where(TinkerSession.key_name == key_name, TinkerSession.heartbeat_at >= since,
                           TinkerSession.finished_at.is_(None)))
    limit = _quota(key_name).max_sessions
    if live >= limit:
        raise TinkerError(403, f"Tinker key {key_name!r} has {live} live sessions, its quota's max_sessions is "
                               f"{limit}: close a ServiceClient (or wait {get_settings().tinker_session_timeout_s:g} "
                               "s after one stopped) or raise the quota in TURNSTILE_TINKER_KEYS")
    row = TinkerSession(id=f"session-{uuid.uuid4()}", key_name=key_name, sdk_version=sdk_version,
                        tags=sorted(set(tags)), user_metadata=dict(user_metadata or {}))
    s.add(row)
    s.flush()
    return row


def session_of(s: Session, key_name: str, session_id: str, *, open_only: bool = False) -> TinkerSession:
    """Session `session_id` of `key_name`; 404 otherwise.  `open_only`: 400 when its client has
    finished it (the SDK's contract: a finished session rejects further operations)."""
    row = s.get(TinkerSession, session_id)
    if row is None or row.key_name != key_name:
        raise TinkerError(404, f"no session {session_id!r} for this key")
    if open_only:
        check_open(row)
    return row


def check_open(session: TinkerSession | None) -> None:
    """400 when `session` was finished by its client (`finish_session`)."""
    if session is not None and session.finished_at is not None:
        raise TinkerError(400, f"session {session.id!r} was finished by its client ({session.finish_reason}): "
                               "operations on it are rejected; start a new ServiceClient")


def heartbeat(s: Session, key_name: str, session_id: str) -> None:
    session_of(s, key_name, session_id).heartbeat_at = utcnow()


FINISH_REASONS = ("success", "errored", "interrupted")


def finish_session(s: Session, key_name: str, session_id: str, *, reason: str, detail: str | None) -> list[int]:
    """The client closed session `session_id` (`ServiceClient.close`, with the SDK's `reason`):
    record it (the first finish wins; a retry changes nothing) and complete the runs of its models
    that have nothing in flight (the watchdog completes the others once theirs finish).  Returns
    the ids of the runs completed now.  404 for another key's session, 400 for an unknown reason."""
    if reason not in FINISH_REASONS:
        raise TinkerError(400, f"finish reason {reason!r} is not one of {', '.join(FINISH_REASONS)}")
    row = session_of(s, key_name, session_id)
    now = utcnow()
    if row.finished_at is None:
        row.finished_at, row.finish_reason, row.finish_detail = now, reason, (detail or None)
        s.flush()
    return tinker_models.finish_idle(s, now, session_timeout_s=get_settings().tinker_session_timeout_s,
                                     session_id=session_id)


def check_model_choice(base_model: str, rank: int | None) -> str:
    """`base_model`'s model spec (`base_model_spec`); 400 naming the supported choices when
    `base_model` or the LoRA `rank` is not one of them."""
    settings = get_settings()
    spec = base_model_spec(base_model)
    if rank is None:
        raise TinkerError(400, "this server trains LoRA adapters only: create_lora_training_client(base_model, rank)")
    if rank not in settings.tinker_lora_ranks:
        raise TinkerError(400, f"LoRA rank {rank} is not allowed here; choose one of "
                               f"{', '.join(map(str, settings.tinker_lora_ranks))} (TURNSTILE_TINKER_LORA_RANKS)")
    return spec


def create_model(s: Session, key_name: str, *, session_id: str, seq_id: int, base_model: str, rank: int,
                 seed: int | None, user_metadata: dict[str, Any] | None,
                 train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True) -> TinkerModel:
    """The model `seq_id` of session `session_id`: made now (its run row of kind `tinker` included),
    or the one an earlier try of the same request made.  400 for an unsupported base model or rank,
    403 over the key's `max_models`."""
    session_of(s, key_name, session_id, open_only=True)
    existing = s.scalars(select(TinkerModel).where(TinkerModel.session_id == session_id,
                                                   TinkerModel.seq_id == seq_id)).first()
    if existing is not None:
        return existing
    base_model = check_model_choice(base_model, rank)
    active = s.scalar(select(func.count()).select_from(TinkerModel).join(Run, Run.id == TinkerModel.run_id)
                      .where(TinkerModel.key_name == key_name, Run.status.in_(ACTIVE_RUN_STATES)))
    limit = _quota(key_name).max_models
    if active >= limit:
        raise TinkerError(403, f"Tinker key {key_name!r} has {active} models, its quota's max_models is {limit}: "
                               "unload one or raise the quota in TURNSTILE_TINKER_KEYS")
    targets = _targets(train_attn, train_mlp)
    training: dict[str, Any] = {"lora": True, "lora_r": rank, "lora_target_modules": targets}
    if seed is not None:
        training["seed"] = seed
    cfg = RunConfig.model_validate({"kind": "tinker", "model": {"name": base_model}, "steps": 0,
                                    "training": training, "scheduling": {"share": _quota(key_name).share}})
    _check_engines(cfg)
    now = utcnow()
    run = Run(kind="tinker", status="running", config=cfg.model_dump(mode="json"), started_at=now,
              name=(user_metadata or {}).get("name") or f"tinker {base_model} r{rank}",
              summary={"tinker": {"session_id": session_id, "key": key_name, "train_unembed": train_unembed,
                                  "user_metadata": dict(user_metadata or {})}})
    s.add(run)
    s.flush()
    s.refresh(run)  # created_at as the database returns it, as a train run's start reads it
    # Run ids restart at 1 in a new or wiped database: a `runs/<id>/` folder left by another
    # database's run of this id (its tinker/current.pt, checkpoints) must not become this model's.
    claim_run_dir(run.id, run.created_at.isoformat())
    trainer_shares.forget(run.id)  # nor its turns on the trainer
    model = TinkerModel(id=f"tinker-{run.id}", run_id=run.id, session_id=session_id, seq_id=seq_id,
                        key_name=key_name, base_model=base_model, lora_rank=rank)
    s.add(model)
    s.flush()
    return model


def _check_engines(cfg: RunConfig) -> None:
    """400 when the engines and trainer cannot take one more LoRA tenant now: the checks a LoRA
    train run meets at creation (`app.control.tenancy`: a full fine-tune holding the engines, a
    loaded eval checkpoint, another engine kind).  Not 409: the SDK retries that status."""
    from app.control.tenancy import engine_problems

    problems = engine_problems(cfg.model_copy(update={"kind": "train"}))
    if problems:
        raise TinkerError(400, "this deployment cannot add a LoRA tenant now: "
                               + "; ".join(f"{field}: {message}" for field, message in problems))


def _targets(train_attn: bool, train_mlp: bool) -> list[str]:
    """LoRA target modules of the SDK's train_attn / train_mlp flags (Llama module names)."""
    attn = ["q_proj", "k_proj", "v_proj", "o_proj"] if train_attn else []
    mlp = ["gate_proj", "up_proj", "down_proj"] if train_mlp else []
    if not attn and not mlp:
        raise TinkerError(400, "train_attn and train_mlp are both false: this server adapts attention and/or MLP "
                               "projections (train_unembed alone is not supported)")
    return attn + mlp


def model_of(s: Session, key_name: str, model_id: str, *, active: bool = False) -> TinkerModel:
    """Model `model_id` of `key_name`; 404 otherwise (another key's model reads as missing).
    `active`: 400 when its run has ended (its client's session went silent, app.control.tinker_models)."""
    row = s.get(TinkerModel, model_id)
    if row is None or row.key_name != key_name:
        raise TinkerError(404, f"no model {model_id!r} for this key")
    if active:
        check_open(s.get(TinkerSession, row.session_id))
        status = s.scalar(select(Run.status).where(Run.id == row.run_id))
        if status not in ACTIVE_RUN_STATES:
            raise TinkerError(400, f"model {model_id!r} has ended (its run {row.run_id} is {status}: its client's "
                                   "session stopped heartbeating): create a new LoRA training client and "
                                   "load_state(path) from one of its saved states")
    return row


def check_inflight(s: Session, key_name: str) -> None:
    """429 when the key has `max_inflight` futures pending or running (the SDK backs off and retries)."""
    n = s.scalar(select(func.count()).select_from(TinkerFuture)
                 .where(TinkerFuture.key_name == key_name, TinkerFuture.status.in_(("pending", "running"))))
    limit = _quota(key_name).max_inflight
    if n >= limit:
        raise TinkerError(429, f"Tinker key {key_name!r} has {n} requests in flight, its quota's max_inflight is "
                               f"{limit}; retry when some finish")


def create_sampling_session(s: Session, key_name: str, *, session_id: str, seq_id: int, base_model: str | None,
                            model_path: str | None) -> TinkerSamplingSession:
    """Sampling session `seq_id` of session `session_id` on `base_model` or on the sampler
    checkpoint `model_path` (tinker://<model id>/...) of one of the key's models; the same row for
    a retry.  400 for neither or an unsupported base model, 404 for another key's model."""
    session_of(s, key_name, session_id, open_only=True)
    existing = s.scalars(select(TinkerSamplingSession).where(TinkerSamplingSession.session_id == session_id,
                                                             TinkerSamplingSession.seq_id == seq_id)).first()
    if existing is not None:
        return existing
    model_id = None
    if model_path:
        model_id = parse_model_path(model_path)
        base_model = model_of(s, key_name, model_id).base_model
    elif not base_model:
        raise TinkerError(400, "create_sampling_client needs model_path (tinker://...) or base_model")
    else:
        base_model = base_model_spec(base_model)
    row = TinkerSamplingSession(id=f"sampler-{uuid.uuid4()}", session_id=session_id, seq_id=seq_id,
                                key_name=key_name, base_model=base_model, model_id=model_id, model_path=model_path)
    s.add(row)
    s.flush()
    return row


def parse_model_path(path: str) -> str:
    """The model id of a `tinker://<model id>/<kind>/<name>` path; 400 for another form."""
    if not path.startswith("tinker://") or "/" not in path[len("tinker://"):]:
        raise TinkerError(400, f"{path!r} is not a tinker://<model id>/<kind>/<name> path")
    return path[len("tinker://"):].split("/", 1)[0]


def sampling_session_of(s: Session, key_name: str, sampling_session_id: str, *,
                        open_only: bool = False) -> TinkerSamplingSession:
    """Sampling session `sampling_session_id` of `key_name`; 404 otherwise.  `open_only`: 400 when
    the session it was made in has been finished (`check_open`)."""
    row = s.get(TinkerSamplingSession, sampling_session_id)
    if row is None or row.key_name != key_name:
        raise TinkerError(404, f"no sampling session {sampling_session_id!r} for this key")
    if open_only:
        check_open(s.get(TinkerSession, row.session_id))
    return row
