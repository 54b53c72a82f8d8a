"""Response models of the REST API: every JSON body is built from these, and the OpenAPI
document (`app.api.openapi`) is generated from them, so the two cannot drift apart.

Timestamps are ISO 8601 strings (UTC); token ids are integers, logprobs float nats.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from app.tables import RUN_KINDS, RUN_STATES, STEP_STATES

# Stored run configs are returned as stored (validated at creation); the OpenAPI document
# points this field at the RunConfig schema (`app.api.openapi`).
StoredRunConfig = Annotated[dict[str, Any], WithJsonSchema({"type": "object", "x-schema": "RunConfig"})]
RunStatus = Literal[RUN_STATES]  # type: ignore[valid-type]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Health(_Out):
    """`GET /api/health`."""

    status: Literal["ok"] = "ok"


class LiveStats(_Out):
    """Cheap aggregates for progress displays (fields a listing does not compute are null)."""

    graded: int = Field(0, description="episodes graded so far")
    reward_mean: float | None = Field(None, description="mean reward of the graded episodes")
    resolved_rate: float | None = Field(None, description="fraction of graded episodes resolved")
    completions: int | None = Field(None, description="model calls captured")
    sampled_tokens: int | None = Field(None, description="tokens sampled by the policy in those calls")


class Step(_Out):
    """One GRPO training step."""

    step: int
    status: Literal[STEP_STATES]  # type: ignore[valid-type]
    policy_version: int | None
    episode_ids: list[int] | None
    metrics: dict[str, Any] | None = Field(description="loss, rewards, merge and scheduling metrics (see README)")
    checkpoint_path: str | None
    error: str | None
    started_at: str | None
    finished_at: str | None


class Trainer(_Out):
    """What a train run's trainer does now (`app.api.trainer_state`)."""

    state: Literal["not_started", "waiting_for_groups", "gpu_queue", "training", "pushing_weights", "failed", "done",
                   "stopped"]
    step: int | None = Field(description="the step it is about (null: done, stopped, not started)")
    text: str = Field(description='one line: "step 1 waiting for its groups (1/2 ready)", "step 1 on the gpu queue '
                                  '(4 s)", "step 1 training (37 s)", "step 1 pushing weights", ...')
    seconds: float | None = Field(description="seconds on the gpu queue or training so far")
    groups_ready: int | None = Field(description="accepted groups waiting for the step (waiting_for_groups)")
    groups_needed: int | None = Field(description="`tasks_per_step` (waiting_for_groups)")


class Run(_Out):
    """A run: train, eval or collect, or a Tinker model (kind tinker)."""

    id: int
    kind: Literal[RUN_KINDS]  # type: ignore[valid-type]
    status: RunStatus
    name: str | None = Field(None, description="what a person calls the run (set at submit or PATCH /api/runs/{run_id})")
    tags: list[str] = Field(default_factory=list, description="the run's tags, lowercase, sorted")
    notes: str | None = Field(None, description="free text about the run")
    policy_version: int
    priority: int
    config: StoredRunConfig
    error: str | None
    summary: dict[str, Any] | None = Field(description="the run summary once finished (see README: Monitoring)")
    provenance: dict[str, str] | None = Field(
        None, description="where each setting of `config` came from, by dotted path: 'file', '--set', 'api', "
                          "'warm start' or 'default' (null: a run created before sources were recorded)")
    episodes_by_status: dict[str, int]
    created_at: str | None
    started_at: str | None
    finished_at: str | None
    live: LiveStats | None = None
    steps: list[Step] | None = Field(None, description="training steps (`GET /api/runs/{run_id}` only)")
    trainer: Trainer | None = Field(None, description="train runs, `GET /api/runs/{run_id}` only: what the "
                                                      "trainer does now")
    tinker: dict[str, Any] | None = Field(
        None, description="kind tinker, `GET /api/runs/{run_id}` only: the Tinker model (model_id, base_model, "
                          "lora_rank, key), its optimizer steps, the loss of each forward_backward, its sampler and "
                          "state checkpoints and futures by status (app.control.tinker_progress)")
    waiting: str | None = Field(None, description="set while a queued (or cancelling) run has waited longer than a "
                                                  "lease plus a watchdog period for a control worker: what is "
                                                  "missing and how long it has waited")
    engines_notice: dict[str, Any] | None = Field(
        None, description="`POST /api/runs` only: a full fine-tune created while other full fine-tunes use its "
                          "engines (allowed; each run's new weights replace the other's): `engines_held_by_runs` "
                          "(ids) and `message`")


class Completion(_Out):
    """One model call through the gateway; token fields only on the one-episode view."""

    id: int
    seq: int
    api: str
    model: str | None
    stream: bool
    finish_reason: str | None
    engine_id: str | None
    policy_version: int | None
    queue_ms: float | None
    first_token_ms: float | None
    total_ms: float | None
    partial: bool
    error: str | None
    rejected_reason: str | None
    prompt_tokens: int
    sampled_tokens: int
    created_at: str | None
    normalized_request: dict[str, Any] | None = None
    response: dict[str, Any] | None = None
    prompt_ids: list[int] | None = None
    sampled_ids: list[int] | None = None
    logprobs: list[float] | None = None
    token_policy_versions: list[int | None] | None = Field(
        None, description="The policy version that sampled each token of `sampled_ids` ([S]; decoded from the "
                          "stored runs: several versions when an in-flight weight update landed mid-completion; "
                          "every entry `policy_version` on rows recorded before per-token capture)")
    token_kv_versions: list[int | None] | None = Field(
        None, description="The oldest version of the KV cache each sampled token attended to ([S]); null when "
                          "none was older than `token_policy_versions` (a `keep` update without KV recompute)")


class GroupState(_Out):
    """What happened to an episode's GRPO group (`app.api.group_state`), in the words every page shows."""

    state: Literal["sampling", "done", "waiting", "training", "trained", "set_aside", "not_trained"]
    step: int | None = Field(description="the step that trained the group, or that will; null when none will")
    label: str = Field(description='"waiting for step N", "training in step N", "trained in step N", '
                                   '"set aside: <reason>", "not trained: <why>"; "sampling" or "done" in eval runs')
    reason: str | None


class FailureReason(_Out):
    """Why an episode ended without resolving its instance (`app.control.failure`)."""

    kind: str = Field(description="no_patch, patch_not_applied, fail_to_pass, pass_to_pass, tampering, "
                                  "no_test_results, timeout, harness_error, setup_error, grading_error, "
                                  "worker_lost, cancelled, forfeit, simulated or error")
    text: str = Field(description="one line: the cause, with the failing tests' names where tests failed")


class Episode(_Out):
    """One harness execution on one task instance."""

    id: int
    run_id: int
    instance_id: str | None
    step: int | None = Field(description="the step that trained the episode's group, or that will "
                                         "(`group.step`); for eval runs the step it was sampled for")
    group: GroupState | None = None
    failure_reason: FailureReason | None = Field(
        None, description="set when the episode ended (failed, cancelled, or completed unresolved)")
    group_index: int
    sample_index: int
    status: str
    attempts: int
    policy_version: int | None
    exit_status: str | None
    timed_out: bool | None
    reward: float | None
    resolved: bool | None
    patch: str | None
    grading_report: dict[str, Any] | None
    merge_stats: dict[str, Any] | None
    error: str | None
    created_at: str | None
    started_at: str | None
    finished_at: str | None
    completions: list[Completion] | None = Field(None, description="`GET /api/episodes/{episode_id}` only")


class RunList(_Out):
    runs: list[Run]


class EpisodeList(_Out):
    episodes: list[Episode]


class ExportTrajectory(_Out):
    """One trained sequence of an episode in `GET /api/runs/{run_id}/export`; every list is one
    entry per position ([T])."""

    builder: str
    chain_index: int
    token_ids: list[int]
    loss_mask: list[int] = Field(description="1 where the policy sampled the token, 0 on context")
    logprobs: list[float] = Field(description="rollout logprob (nats) where `loss_mask` is 1, 0.0 elsewhere")
    completion_ids: list[Any] = Field(description="the completions merged into the sequence, in order")
    token_policy_versions: list[int | None] = Field(
        description="the policy version that sampled each token; null on context positions (`loss_mask` 0)")
    token_kv_versions: list[int | None] | None = Field(
        description="the oldest KV version each sampled token attended to (null on context); null as a whole "
                    "when no merged completion recorded KV older than its weights")


class ExportLine(Episode):
    """One line of `GET /api/runs/{run_id}/export`: the episode, its conversation for SFT, its
    completions with token ids and its trajectories."""

    completions: list[Completion] = Field(description="every call the episode made, with its token ids")
    messages: list[dict[str, Any]] | None = Field(
        description="the last usable call's messages (Chat Completions form) plus its sampled answer")
    trajectories: list[ExportTrajectory]


RESPONSE_MODELS = (Health, LiveStats, Step, Trainer, Run, Completion, GroupState, FailureReason, Episode, RunList,
                   EpisodeList, ExportTrajectory, ExportLine)
