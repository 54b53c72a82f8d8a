"""SQLAlchemy 2 models: the durable record of runs, episodes, completions and steps.

SQL is the one source of truth.  Status columns only
change through `app.transitions.transition`, a compare-and-set UPDATE, so two workers
that receive the same redelivered message cannot both win a transition.
Token arrays use the packed types of `app.arrays` (4 bytes per entry).
"""
from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from app.arrays import Float32Array, Int32Array, UInt8Array
from app.runconfig import RunConfig

JSONType = JSON().with_variant(JSONB(), "postgresql")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def aware_utc(value: dt.datetime | None) -> dt.datetime | None:
    """`value` with its time zone: SQLite returns naive datetimes for the timezone-aware columns
    (stored as UTC), PostgreSQL aware ones, so this makes either comparable with `utcnow()`.
    None stays None; an aware value is returned unchanged."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=dt.timezone.utc)
    return value


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSONType, list[Any]: JSONType}


# --- runs ---------------------------------------------------------------------------

RUN_KINDS = ("train", "eval", "collect", "tinker")  # tinker: a model of the Tinker service (app.tinker)
RUN_STATES = (
    "queued",      # created; control.start_run not yet done
    "running",     # episodes and steps in progress
    "cancelling",  # cancel requested; live episodes being stopped
    "completed",   # every episode terminal (and every step trained)
    "failed",      # gave up (error says why)
    "cancelled",   # cancel finished
)


class Run(Base):
    """One user request: train, eval or collect over a task set with a harness and a model."""

    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSONType)
    policy_version: Mapped[int] = mapped_column(Integer, default=0)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    # What a person calls the run (app.api.labels checks them): not run options, so editable at any time
    name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    tags: Mapped[list[Any] | None] = mapped_column(JSONType, nullable=True)  # lowercase, sorted; NULL: none
    notes: Mapped[str | None] = mapped_column(Text, nullable=True)
    # {dotted config path: "file" | "--set" | "api" | "warm start" | "default"} (app.provenance); NULL on older runs
    provenance: Mapped[dict[str, str] | None] = mapped_column(JSONType, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)

    episodes: Mapped[list["Episode"]] = relationship(back_populates="run", cascade="all, delete-orphan")
    steps: Mapped[list["TrainingStep"]] = relationship(back_populates="run", cascade="all, delete-orphan")

    def run_config(self) -> RunConfig:
        """`config` as the validated `RunConfig` (defaults filled in; stored configs were validated at creation).

        Raises `pydantic.ValidationError` if the stored JSON no longer validates.
        """
        return RunConfig.model_validate(self.config)

    def start_weights(self) -> tuple[str, int] | None:
        """(model folder, policy version) of the checkpoint this run's engines loaded when it started
        (summary `start_weights`, written by the run's start from `model.checkpoint`; the folder's
        real path, the name engines report for it), or None: the engines' own base weights.  The
        watchdog, the trainer and the gateway keep engines on it."""
        start = (self.summary or {}).get(START_WEIGHTS)
        return (str(start["path"]), int(start["policy_version"])) if start else None


START_WEIGHTS = "start_weights"  # Run.summary key: {"path", "policy_version"} (Run.start_weights)


# --- task instances -----------------------------------------------------------------


class TaskInstance(Base):
    """One SWE-bench-format problem, stored as given (`record`) plus the keys we query on."""

    __tablename__ = "task_instances"
    __table_args__ = (UniqueConstraint("task_set", "instance_id", name="uq_task_instance"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    task_set: Mapped[str] = mapped_column(String(255))
    instance_id: Mapped[str] = mapped_column(String(255))
    repo: Mapped[str] = mapped_column(String(255))
    base_commit: Mapped[str | None] = mapped_column(String(64), nullable=True)
    record: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


# --- groups -------------------------------------------------------------------------

GROUP_STATES = (
    "open",      # episodes still running
    "complete",  # every episode terminal; not yet judged
    "accepted",  # usable and fresh enough; waiting for a training step
    "trained",   # consumed by training step `step`
    "rejected",  # too few usable episodes (reason says why)
    "dropped",   # too stale for the current policy (reason says why)
    "filtered",  # equal rewards, so no advantage: set aside by dynamic sampling for step `step`
    "done",      # eval/collect group finished
)


class Group(Base):
    """GRPO's group: `group_size` episodes of one task instance, judged together."""

    __tablename__ = "groups"
    __table_args__ = (UniqueConstraint("run_id", "group_index", name="uq_group_index"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    group_index: Mapped[int] = mapped_column(Integer)
    instance_id: Mapped[int] = mapped_column(ForeignKey("task_instances.id"))
    status: Mapped[str] = mapped_column(String(16), default="open")
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)  # training step that consumed it
    weight: Mapped[float] = mapped_column(Float, default=1.0)  # < 1 when down-weighted for staleness
    policy_version: Mapped[int] = mapped_column(Integer, default=0)  # policy version when created
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    completed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


# --- episodes -----------------------------------------------------------------------

EPISODE_STATES = (
    "queued",     # row exists, prepare not yet started
    "preparing",  # a runtime is being built
    "ready",      # runtime in the READY buffer, waiting for a rollout slot
    "running",    # harness running; its session token is live at the gateway
    "grading",    # harness done (or timed out); tests running in a fresh runtime
    "completed",  # graded; reward is set
    "failed",     # gave up explicitly (error says why)
    "cancelled",  # run cancelled or straggler cut
)


class Episode(Base):
    """One harness execution on one task instance; owns one gateway session."""

    __tablename__ = "episodes"
    __table_args__ = (
        UniqueConstraint("run_id", "group_index", "sample_index", name="uq_episode_slot"),
        Index("ix_episodes_run_status", "run_id", "status"),
        Index("ix_episodes_status_lease", "status", "lease_expires_at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    instance_id: Mapped[int] = mapped_column(ForeignKey("task_instances.id"))
    step: Mapped[int] = mapped_column(Integer, default=0)  # training step the group is meant for
    group_index: Mapped[int] = mapped_column(Integer)
    sample_index: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default="queued")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # The stage lease (app.control.lease): which worker process holds the episode's current
    # stage (NULL while the stage's message waits for a worker) and until when; the holder
    # renews it while it works, and the watchdog re-dispatches or fails an expired one.
    lease_owner: Mapped[str | None] = mapped_column(String(255), nullable=True)
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    redeliveries: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # re-dispatches so far
    # sha256 hex of the episode's gateway API key; the key itself is never stored.
    session_token_hash: Mapped[str | None] = mapped_column(String(64), unique=True, nullable=True)
    policy_version: Mapped[int | None] = mapped_column(Integer, nullable=True)  # version at rollout start
    runtime: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    patch: Mapped[str | None] = mapped_column(Text, nullable=True)
    exit_status: Mapped[str | None] = mapped_column(String(64), nullable=True)
    timed_out: Mapped[bool] = mapped_column(Boolean, default=False)
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    resolved: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    grading_report: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    merge_stats: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    prepared_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    rollout_finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)

    run: Mapped[Run] = relationship(back_populates="episodes")
    instance: Mapped[TaskInstance] = relationship()
    completions: Mapped[list["Completion"]] = relationship(
        back_populates="episode", cascade="all, delete-orphan", order_by="Completion.seq"
    )


# --- completions --------------------------------------------------------------------


# `Completion.rejected_reason` of an earlier attempt's rows once a new attempt is claimed.
SUPERSEDED = "superseded"


class Completion(Base):
    """One model call through the gateway: what the policy saw and what it sampled.

    `prompt_ids` (int32, [P]) are the ids the engine rendered; `sampled_ids` (int32, [S])
    and `logprobs` (float32 nats, [S]) are the engine's sampled tokens and their
    log-probabilities under the weights that sampled them.  `policy_version` is the version of
    the first sampled token (the oldest); `policy_versions` the run-length encoded version of
    every token, `[[first token index, version], ...]` in index order, from the engine's own
    report (several runs when an in-flight weight update landed mid-completion; None on rows
    older than per-token capture: `policy_version` then covers all).  `kv_versions` (same shape,
    None when equal to `policy_versions`): the oldest version of the KV each token attended to,
    older than its sampling version only after a `keep` update without KV recompute.
    Encoding and decoding: `app.versions`.
    `routed_experts` (MoE policies only, else None): the engine's chosen expert ids of the
    prompt and every sampled token but the last, `app.engines.route_bytes.to_bytes` bytes
    (int16 LE, `[P + S - 1, layers, top_k]`); `route_shape` is `[layers, top_k]`.
    """

    __tablename__ = "completions"
    __table_args__ = (
        UniqueConstraint("episode_id", "seq", name="uq_completion_seq"),
        # Not unique: a harness may repeat an identical call on purpose (app.proxy.record).
        Index("ix_completion_request_key", "episode_id", "attempt", "request_key"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    episode_id: Mapped[int] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), index=True)
    seq: Mapped[int] = mapped_column(Integer)
    # The episode's rollout attempt whose session made the call; only the episode's current
    # attempt is trained, and attempts never overwrite each other's rows.
    attempt: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    request_key: Mapped[str] = mapped_column(String(128))
    api: Mapped[str] = mapped_column(String(32))  # anthropic | chat | responses | gemini
    model: Mapped[str | None] = mapped_column(String(255), nullable=True)
    stream: Mapped[bool] = mapped_column(Boolean, default=False)
    raw_request: Mapped[dict[str, Any]] = mapped_column(JSONType)
    normalized_request: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    response: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    response_id: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)
    prompt_ids: Mapped[list[int] | None] = mapped_column(Int32Array, nullable=True)
    sampled_ids: Mapped[list[int] | None] = mapped_column(Int32Array, nullable=True)
    logprobs: Mapped[list[float] | None] = mapped_column(Float32Array, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    engine_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    policy_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    policy_versions: Mapped[list[list[int]] | None] = mapped_column(JSONType, nullable=True)
    kv_versions: Mapped[list[list[int]] | None] = mapped_column(JSONType, nullable=True)
    routed_experts: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    route_shape: Mapped[list[int] | None] = mapped_column(JSONType, nullable=True)
    queue_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    first_token_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    total_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    partial: Mapped[bool] = mapped_column(Boolean, default=False)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Set by trajectory building when this capture cannot be trained on (kept for inspection).
    rejected_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    episode: Mapped[Episode] = relationship(back_populates="completions")


# --- trajectories and training steps ------------------------------------------------


class Trajectory(Base):
    """One training sequence built from an episode's completions (a chain).

    `token_ids` int32 [T]; `loss_mask` uint8 [T] (1 = sampled by the policy);
    `logprobs` float32 [T] (rollout logprob where mask is 1, 0.0 elsewhere).
    `routed_experts` (MoE policies only, else None): the chain's expert ids int16
    `[T, layers, top_k]` as `app.engines.route_bytes.to_bytes` bytes, -1 at the last token;
    the shape `[layers, top_k]` is `meta["route_shape"]`.
    """

    __tablename__ = "trajectories"
    __table_args__ = (UniqueConstraint("episode_id", "builder", "chain_index", name="uq_trajectory_chain"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    episode_id: Mapped[int] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), index=True)
    builder: Mapped[str] = mapped_column(String(32))  # prefix_merging | per_request
    chain_index: Mapped[int] = mapped_column(Integer)
    token_ids: Mapped[list[int]] = mapped_column(Int32Array)
    loss_mask: Mapped[list[int]] = mapped_column(UInt8Array)
    logprobs: Mapped[list[float]] = mapped_column(Float32Array)
    completion_ids: Mapped[list[Any]] = mapped_column(JSONType)
    meta: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    routed_experts: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TeacherScore(Base):
    """A distillation teacher's prefill scores of one chain (`app.training.teacher`).

    Keyed by (`chain_hash`, `teacher_version`): `chain_hash` is the SHA-256 of the chain's
    token ids and loss mask (`teacher.chain_hash`), so every trajectory with those exact ids
    shares one score.  `logprobs` float32 [T], beside `Trajectory.logprobs`: the teacher's
    log-probability (nats) of each sampled token (loss mask 1), 0.0 elsewhere.  `seconds`:
    the teacher's wall time for the chain.  With `top_k` k > 0 (`training.opd_divergence`
    topk_forward_kl) the teacher's k likeliest tokens at each position are kept too, flattened
    row-major: `top_ids` int32 [T * k] and `top_logprobs` float32 [T * k] (nats, descending per
    position; 0 and 0.0 at loss-mask-0 positions); the key's `teacher_version` then carries
    the k (`teacher.score_key`), so scores with and without them never mix.
    """

    __tablename__ = "teacher_scores"
    __table_args__ = (UniqueConstraint("chain_hash", "teacher_version", name="uq_teacher_score"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    chain_hash: Mapped[str] = mapped_column(String(64))
    teacher_version: Mapped[str] = mapped_column(String(128))
    logprobs: Mapped[list[float]] = mapped_column(Float32Array)
    tokens: Mapped[int] = mapped_column(Integer)  # sampled tokens scored
    seconds: Mapped[float] = mapped_column(Float)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    top_k: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    top_ids: Mapped[list[int] | None] = mapped_column(Int32Array, nullable=True)
    top_logprobs: Mapped[list[float] | None] = mapped_column(Float32Array, nullable=True)


STEP_STATES = ("pending", "training", "completed", "failed")


class TrainingStep(Base):
    """One GRPO optimizer update of a run: its metrics and the checkpoint it produced."""

    __tablename__ = "training_steps"
    __table_args__ = (UniqueConstraint("run_id", "step", name="uq_training_step"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    policy_version: Mapped[int | None] = mapped_column(Integer, nullable=True)  # version after the update
    episode_ids: Mapped[list[Any] | None] = mapped_column(JSONType, nullable=True)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    checkpoint_path: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    run: Mapped[Run] = relationship(back_populates="steps")

    def start_values(self, now: dt.datetime) -> dict[str, Any]:
        """Column values for the step's move to `training` at `now`: `started_at`, and on its
        first start its wait on the gpu queue (created -> started, seconds) as the scheduler
        metric `scheduling.gpu_queue_wait_s` (a re-sent step keeps the first wait)."""
        metrics = dict(self.metrics or {})
        scheduling = dict(metrics.get("scheduling") or {})
        if "gpu_queue_wait_s" not in scheduling:
            scheduling["gpu_queue_wait_s"] = max(0.0, (now - aware_utc(self.created_at)).total_seconds())
        return {"started_at": now, "metrics": {**metrics, "scheduling": scheduling}}


# --- the Tinker service (app.tinker) ------------------------------------------------

TINKER_FUTURE_STATES = (
    "pending",    # created; its Celery task not yet started
    "running",    # claimed by a worker under a lease (`lease_expires_at`)
    "completed",  # `result` holds the SDK's response JSON for the op
    "failed",     # `error` holds {"error": message, "category": "User" | "Server" | "Unknown"}
)


class TinkerSession(Base):
    """One Tinker SDK client session (`POST /api/v1/create_session`), kept alive by heartbeats."""

    __tablename__ = "tinker_sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_name: Mapped[str] = mapped_column(String(64), index=True)  # the API key's name (app.tinker.keys)
    sdk_version: Mapped[str] = mapped_column(String(32))
    tags: Mapped[list[Any]] = mapped_column(JSONType)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    heartbeat_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Set once by `POST /api/v1/sessions/<id>/finish` (ServiceClient.close / its context's exit):
    # the SDK's reason "success" | "errored" | "interrupted", and its detail text.
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    finish_detail: Mapped[str | None] = mapped_column(Text, nullable=True)


class TinkerModel(Base):
    """A Tinker training model: a LoRA tenant of the trainer, recorded as the `runs` row of kind
    `tinker` it trains under (`run_id`).  `id` is the SDK's model id."""

    __tablename__ = "tinker_models"
    __table_args__ = (UniqueConstraint("session_id", "seq_id", name="uq_tinker_model_seq"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), unique=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("tinker_sessions.id", ondelete="CASCADE"), index=True)
    seq_id: Mapped[int] = mapped_column(Integer)  # the SDK's model_seq_id within its session
    key_name: Mapped[str] = mapped_column(String(64), index=True)
    base_model: Mapped[str] = mapped_column(String(255))
    lora_rank: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TinkerSamplingSession(Base):
    """A sampling session (`POST /api/v1/create_sampling_session`): the base model, or a sampler
    checkpoint (`model_path`, tinker://<model id>/sampler_weights/<name>) of one of the key's models."""

    __tablename__ = "tinker_sampling_sessions"
    __table_args__ = (UniqueConstraint("session_id", "seq_id", name="uq_tinker_sampling_seq"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("tinker_sessions.id", ondelete="CASCADE"), index=True)
    seq_id: Mapped[int] = mapped_column(Integer)  # the SDK's sampling_session_seq_id
    key_name: Mapped[str] = mapped_column(String(64), index=True)
    base_model: Mapped[str] = mapped_column(String(255))
    model_id: Mapped[str | None] = mapped_column(ForeignKey("tinker_models.id", ondelete="CASCADE"), nullable=True)
    model_path: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    clients: Mapped[int] = mapped_column(Integer, default=1)  # join_sampling_session hands out client counters
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TinkerFuture(Base):
    """One Tinker op the SDK polls for (`retrieve_future`): SQL is its one source of truth.

    `request_id` is the SDK's idempotency key for the request (its retries send the same one), so a
    retried request finds its row instead of making a second.  `payload` is the request's JSON (the
    SDK pydantic type's `model_dump(mode="json")`), `result` the response type's JSON.  Status moves
    by compare-and-set only (`app.control.tinker_futures`); a running row holds a lease that the
    reaper sees expire.
    """

    __tablename__ = "tinker_futures"

    id: Mapped[int] = mapped_column(primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128), unique=True)
    key_name: Mapped[str] = mapped_column(String(64), index=True)
    model_id: Mapped[str | None] = mapped_column(ForeignKey("tinker_models.id", ondelete="CASCADE"),
                                                 nullable=True, index=True)
    sampling_session_id: Mapped[str | None] = mapped_column(
        ForeignKey("tinker_sampling_sessions.id", ondelete="CASCADE"), nullable=True, index=True)
    op: Mapped[str] = mapped_column(String(32))
    seq_id: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the SDK's per-client order of requests
    status: Mapped[str] = mapped_column(String(16), default="pending", index=True)
    payload: Mapped[dict[str, Any]] = mapped_column(JSONType)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # claims so far (a re-claim after a lost lease: 2)
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
