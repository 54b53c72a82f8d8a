"""The validated configuration of a run (the body of `POST /api/runs`).

pydantic does the validation; `RunConfig.model_validate(body)` raises
`pydantic.ValidationError` whose entries name the offending field, which the API
turns into a 400.  Unknown top-level fields are rejected (a typo such as
`group_sise` must not silently fall back to a default).

Kept whole: one job, the declared schema of a run's body; its length is the fields' descriptions.
"""
from __future__ import annotations

import difflib
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

HARNESSES = ("mini-swe-agent", "codex", "claude-code", "qwen-code", "gemini-cli", "opencode", "pi")

AdvantageMode = Literal["mean", "leave_one_out"]
LossAggregation = Literal["token", "sequence"]
Builder = Literal["prefix_merging", "per_request"]
KLEstimator = Literal["k3", "k2"]
# Off-policy correction of tokens sampled by older weights or a drifting engine (app.training.correction):
# at most one weight (token_tis | seq_tis), any of the masks (seq_mis, geo_mask, icepop), or none.
OffPolicyCorrection = Literal["token_tis", "seq_tis", "seq_mis", "geo_mask", "icepop", "none"]
OFF_POLICY_CORRECTIONS: tuple[str, ...] = get_args(OffPolicyCorrection)
CORRECTION_WEIGHTS = ("token_tis", "seq_tis")
CORRECTION_MASKS = ("seq_mis", "geo_mask", "icepop")
Algorithm = Literal["grpo", "opd", "grpo+opd"]
OPDBaseline = Literal["none", "step_mean"]
OPDDivergence = Literal["sampled_reverse_kl", "topk_forward_kl"]
# vLLM's default `max_logprobs` (the most `prompt_logprobs` it returns per token) and the embedded engine's
MAX_OPD_TOPK = 20
LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS: tuple[str, ...] = get_args(LoraTarget)
RuntimeKind = Literal["auto", "local", "oci", "docker", "podman"]
# The weight update mode: what an engine does with running requests when new weights arrive.
# keep: they freeze between two decode steps and continue on the new weights; wait: they finish on the
# old weights first (new ones queue); abort: they end now with their partial answer (finish_reason "abort").
WeightUpdateMode = Literal["keep", "wait", "abort"]
WEIGHT_UPDATE_MODES: tuple[str, ...] = get_args(WeightUpdateMode)
RUNTIME_KINDS: tuple[str, ...] = get_args(RuntimeKind)
ADVANTAGE_MODES: tuple[str, ...] = get_args(AdvantageMode)
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)
BUILDERS: tuple[str, ...] = get_args(Builder)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
ALGORITHMS: tuple[str, ...] = get_args(Algorithm)


class Timeouts(BaseModel):
    """Per-stage time budgets in seconds."""

    model_config = ConfigDict(extra="forbid")

    prepare_s: int = Field(900, ge=1, le=24 * 3600)
    agent_s: int = Field(600, ge=1, le=24 * 3600, description="harness wall-clock budget per episode")
    grade_s: int = Field(600, ge=1, le=24 * 3600)


class ModelChoice(BaseModel):
    """Which policy serves the episodes: the embedded CPU engine or external (vLLM) engines."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("smollm2", min_length=1, max_length=255, description="'smollm2', 'tiny', or a served model name")
    engine: Literal["embedded", "vllm"] = "embedded"
    engine_urls: list[Annotated[str, Field(max_length=2048)]] = Field(
        default_factory=list, max_length=256, description="override TURNSTILE_ENGINE_URLS")
    checkpoint: str | None = Field(
        None, description="weights loaded into the engines before the run starts (and, for a train run, the "
                          "weights it trains from: its policy version 0); a checkpoint model folder or, for eval and "
                          "collect runs, 'run:<id>' (that train run's newest checkpoint)")
    weight_update_mode: WeightUpdateMode = Field(
        "keep", description="what the engines do with running requests when this run's new weights load: 'keep' (they "
                            "continue between two decode steps on the new weights; every sampled token records the "
                            "version that sampled it), 'wait' (they finish on the old weights first while new calls "
                            "wait), 'abort' (they end with their partial answer, finish_reason 'abort')")
    recompute_kv: bool = Field(
        True, description="with weight_update_mode 'keep': re-prefill running requests' context under the new weights "
                          "(false: their KV cache stays as the old weights computed it, a partial rollout; each token "
                          "then also records the oldest version of the KV it was conditioned on)")


class Budget(BaseModel):
    """Per-episode agent budget (passed to the harness preset)."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(8, ge=1, le=1000)
    max_tokens: int = Field(256, ge=1, le=131072, description="max sampled tokens per model call")


class Simulation(BaseModel):
    """Simulated stages (no harness, no grader, no trainer): the scheduler bench and spine tests.

    Episode durations are lognormal: median `episode_median_s`, log-sigma `episode_sigma`
    (sigma 1.0 gives p99 ≈ 10x the median).  Rewards are Bernoulli(`reward_p`).
    """

    model_config = ConfigDict(extra="forbid")

    episode_median_s: float = Field(1.0, ge=0, le=3600)
    episode_sigma: float = Field(0.0, ge=0, le=5)
    max_episode_s: float | None = Field(None, ge=0)
    prepare_s: float = Field(0.0, ge=0, le=3600)
    train_s: float = Field(0.0, ge=0, le=3600)
    reward_p: float = Field(0.5, ge=0, le=1)
    seed: int = 0


class Scheduling(BaseModel):
    """Asynchronous rollout: groups kept in flight beyond the step being trained, the staleness
    bound on what is trained, straggler cuts, rollout slots and the READY buffer depth."""

    model_config = ConfigDict(extra="forbid")

    max_async_level: int = Field(1, ge=0, le=16, description="steps of groups kept in flight beyond the current one")
    max_staleness: int = Field(2, ge=0, le=64, description="versions a group may lag the policy")
    stale_policy: Literal["drop", "downweight"] = "drop"
    min_usable: int | None = Field(None, ge=1, description="graded episodes after which a group's stragglers may be cancelled")
    cancel_stragglers: bool = False
    min_accept_fraction: float = Field(0.5, ge=0, le=1)
    rollout_slots: int = Field(4, ge=1, le=1024, description="episodes running at once for this run")
    ready_depth: int = Field(2, ge=0, le=1024, description="prepared runtimes kept waiting in the READY buffer")
    share: float = Field(1.0, gt=0, le=1000, allow_inf_nan=False,
                         description="weight of this run's fair share of the deployment's rollout workers while other "
                                     "runs want them too (app.control.shares); a run alone keeps its rollout_slots")
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling (Yu et al. 2025, arXiv:2503.14476 §3.2): a train group whose usable "
                           "rewards are all equal has zero advantage, so it is set aside ('filtered', not trained) and "
                           "another group is drawn in its place, up to max_filtered_groups per step")
    max_filtered_groups: int = Field(
        6, ge=0, le=1024, description="with dynamic_sampling: groups set aside per step before uniform groups are "
                                      "trained anyway (a policy that solves all or none never blocks the run)")
    max_failed_episodes: int | None = Field(
        None, ge=1, description="fail the run once this many episodes failed (default: 2 x group_size x tasks_per_step)")


class TeacherChoice(BaseModel):
    """The teacher of on-policy distillation: a model sharing the student's tokenizer that
    prefill-scores the token ids the student sampled (`app.training.teacher`).

    `checkpoint` (a model folder) or `name` ('smollm2', 'tiny', or, with `engine_urls`, the model
    name a vLLM or embedded engine serves).  Without `engine_urls` the `teacher` worker loads the
    weights itself (the embedded engine's model code); with them it asks those engines for
    `prompt_logprobs` on `/v1/completions` (vLLM's field).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str | None = Field(None, min_length=1, max_length=255, description="'smollm2', 'tiny', or a served model name")
    checkpoint: str | None = Field(None, min_length=1, max_length=4096, description="a checkpoint model folder")
    engine_urls: list[Annotated[str, Field(max_length=2048)]] = Field(
        default_factory=list, max_length=256, description="engines serving the teacher (empty: scored in the teacher worker)")
    version: str | None = Field(
        None, min_length=1, max_length=128, description="cache key of the teacher's weights (default: derived from "
                                                        "the checkpoint's files, or the name)")
    timeout_s: float = Field(900.0, gt=0, le=24 * 3600, description="how long a training step waits for its chains' "
                                                                    "teacher scores before it fails")
    score_as_graded: bool = Field(True, description="score each episode's chains as soon as it is graded (false: "
                                                    "only when its training step starts)")

    @model_validator(mode="after")
    def _one_source(self) -> "TeacherChoice":
        if not self.name and not self.checkpoint:
            raise ValueError("teacher: give a checkpoint folder or a model name")
        if self.engine_urls and not self.name:
            raise ValueError("teacher.name: a teacher served by engine_urls needs the model name they serve")
        return self


class TrainingConfig(BaseModel):
    """GRPO trainer settings: the `training` section of a run, validated when the run is created.

    Strict types (JSON numbers for numbers, JSON booleans for flags): `{"lora": "false"}` or
    `{"learning_rate": "abc"}` is a 400 at `POST /api/runs`, never a surprise at the first
    training step.  The objective is GRPO (Shao et al. 2024, arXiv:2402.03300) with DAPO's
    clip-higher and token-level loss (Yu et al. 2025, arXiv:2503.14476) and truncated
    importance sampling against the rollout policy (Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training").
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    # the update
    learning_rate: float = Field(1e-6, gt=0, description="AdamW learning rate (constant).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the global gradient norm to this (0 = no clipping).")
    micro_batch_tokens: int = Field(
        8192, ge=16, description="Token budget of one micro-batch: the packed length with `packing`, padding included "
                                 "(rows x longest row) without. A single sequence longer than this gets a micro-batch "
                                 "of its own.")
    packing: bool | None = Field(
        None, description="Pack several sequences into one row of a micro-batch (position ids restart per sequence, "
                          "variable-length attention, no padding) instead of padding one sequence per row. None: pack "
                          "when the model's attention has variable-length kernels (flash_attention_2/3, "
                          "flex_attention); with sdpa or eager a packed row costs a dense masked attention over "
                          "the whole row, (sum of lengths)^2, so pad instead.")
    max_sequence_tokens: int | None = Field(
        None, ge=16, description="Longest single sequence (merged chain) the trainer accepts; a longer one fails the "
                                 "step before any forward pass, with an error naming both lengths. None: the "
                                 "model's max_position_embeddings.")
    activation_checkpointing: bool | None = Field(
        None, description="Recompute the decoder layers' activations in the backward pass instead of storing them "
                          "(less memory per token, ~1/3 more compute). None: on when training on CUDA, off on CPU, "
                          "where the CPU models and contexts fit memory and compute is the bottleneck.")
    activation_memory_gib: float | None = Field(
        None, gt=0, description="Activation memory (GiB) the largest micro-batch of a step may use, for the checkpointing "
                                "chosen per step when `activation_checkpointing` is None (none, every k-th layer, or "
                                "full, from a memory model of the micro-batch's tokens: app/training/memory.py). None: "
                                "85% of the free device memory on CUDA; on CPU no checkpointing.")
    gradient_accumulation_steps: int | None = Field(
        None, ge=1, description="Micro-batches accumulated per optimizer update. None: all micro-batches of a step "
                                "accumulate into one update (on-policy). A number k splits the step into several "
                                "updates; later ones are off-policy and the PPO clip applies to them.")
    # the objective
    advantage_mode: AdvantageMode = Field("mean", description="Group baseline: the group mean, or leave-one-out.")
    normalize_advantage_std: bool = Field(True, description="Divide advantages by the group's reward std.")
    clip_low: float = Field(0.2, ge=0, lt=1, description="PPO clip range below 1 (ratio >= 1 - clip_low).")
    clip_high: float = Field(0.28, ge=0, description="PPO clip range above 1 (DAPO clip-higher).")
    tis_cap: float | None = Field(2.0, ge=1, description="Cap C of the truncated importance weight trainer/rollout "
                                                          "of off_policy_correction token_tis (null disables TIS).")
    off_policy_correction: list[OffPolicyCorrection] = Field(
        ["token_tis"], min_length=1, max_length=4,
        description="How tokens sampled by older weights or a drifting engine are weighted or masked, from the "
                    "ratio r_t = exp(old_t - rollout_t) (app.training.correction). A name or a list: at most one "
                    "weight, \"token_tis\" (min(r_t, tis_cap), Yao et al. 2025; the default, as before) or "
                    "\"seq_tis\" (min(prod_t r_t, seq_is_cap) on every token of the chain, Seq-TIS), plus any of the "
                    "masks \"seq_mis\" (chains whose prod_t r_t is outside seq_mis_bounds leave the loss, Seq-MIS), "
                    "\"geo_mask\" (chains whose exp(mean_t log r_t) is outside geo_mask_bounds leave it, SkyRL) and "
                    "\"icepop\" (tokens whose r_t is outside icepop_bounds leave it, IcePop); \"none\" alone: "
                    "neither. Masked tokens leave the loss's denominator too. With a mask the trainer runs one more "
                    "no-grad forward per step to know the masks before it weights the step.")
    seq_is_cap: float = Field(
        5.0, ge=1, description="Cap of the chain-level importance weight of off_policy_correction seq_tis. The "
                               "default is SkyRL's published value (verl suggests 2-10).")
    seq_mis_bounds: list[float] = Field(
        [0.5, 2.0], min_length=2, max_length=2,
        description="[lo, hi] of the chain weight prod_t r_t kept by off_policy_correction seq_mis. The default is "
                    "verl's and SkyRL's published value; on a measured keep/wait run it kept every on-policy chain (spread "
                    "1e-4 nats) and masked lagged ones at both ends in 4 of 8 steps (docs/inflight-updates.md).")
    geo_mask_bounds: list[float] = Field(
        [0.99, 1.01], min_length=2, max_length=2,
        description="[lo, hi] of the geometric-mean ratio exp(mean_t log r_t) kept by off_policy_correction "
                    "geo_mask. The default is SkyRL's published value; on a measured keep/wait run it kept every on-policy "
                    "chain (spread 1e-6) and masked a lagged one in 1 of 8 steps (docs/inflight-updates.md).")
    icepop_bounds: list[float] = Field(
        [0.5, 2.0], min_length=2, max_length=2,
        description="[alpha, beta] of the token ratio r_t kept by off_policy_correction icepop. The default is "
                    "SkyRL's published value (the IcePop paper used [0.5, 5.0]); on a measured keep/wait run it kept every "
                    "on-policy token and masked under 0.1% of lagged ones (docs/inflight-updates.md).")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty to the initial policy (0 = off).")
    kl_estimator: KLEstimator = Field(
        "k3", description="Per-token KL term put in the loss. \"k3\" (exp(d) - d - 1, d = ref - logp; the default, "
                          "as in DeepSeekMath): its value estimates KL(policy || ref), but its gradient is that of "
                          "the forward KL(ref || policy). \"k2\" (d^2 / 2): its gradient is that of the reverse "
                          "KL(policy || ref) (Tang & Munos 2025, arXiv:2506.09477). The reported `kl` metric is k3's "
                          "value either way.")
    loss_aggregation: LossAggregation = Field("token", description="Loss mean over tokens of the batch, or per sequence.")
    algorithm: Algorithm = Field(
        "grpo", description="\"grpo\": the group advantage on every sampled token. \"opd\": on-policy distillation, "
                            "A_t = opd_coef * (log pi_teacher - log pi_student,rollout) per sampled token. "
                            "\"grpo+opd\": their sum (app.training.opd).")
    teacher: TeacherChoice | None = Field(None, description="the distillation teacher (algorithm opd or grpo+opd)")
    opd_coef: float = Field(1.0, gt=0, le=100, description="weight of the per-token distillation advantage")
    opd_baseline: OPDBaseline = Field(
        "none", description="\"none\": A_t as written (the Thinking Machines recipe). \"step_mean\": the mean of "
                            "opd_coef * (log pi_teacher - log pi_student,rollout) over the step's sampled tokens is "
                            "subtracted from every sampled token's distillation advantage (a constant baseline: the "
                            "expected gradient is unchanged, its variance falls; app.training.opd).")
    opd_divergence: OPDDivergence = Field(
        "sampled_reverse_kl", description="\"sampled_reverse_kl\": the teacher scores each sampled token and "
                                          "opd_coef * (log pi_teacher - log pi_student,rollout) is its advantage. "
                                          "\"topk_forward_kl\": the teacher also returns its opd_topk likeliest "
                                          "tokens at each sampled position and the loss adds opd_coef * KL(teacher || "
                                          "student) over those tokens and one bucket for the rest of the vocabulary, "
                                          "which raises tokens the student never samples (app.training.opd).")
    opd_topk: int = Field(8, ge=1, le=MAX_OPD_TOPK, description="teacher tokens per position for opd_divergence "
                                                                "topk_forward_kl (at most vLLM's default max_logprobs)")
    skip_zero_advantage: bool = Field(
        False, description="Leave chains whose every trainable token has advantage 0 out of the step's micro-batches, "
                           "so they never reach a forward pass (their loss and gradient are exactly 0; the step's "
                           "aggregation weights still count them, so the update is the same). Applies with kl_coef 0, "
                           "one update per step and no off_policy_correction mask (a mask may drop their tokens from "
                           "the loss's denominator, so it must see them); the trainer-vs-rollout logprob gap is then measured on the "
                           "trained chains only. false: such chains run a forward pass (no backward) for the gap.")
    # the data
    builder: Builder = Field("prefix_merging", description="Trajectory builder.")
    # the model
    lora: bool = Field(False, description="Train LoRA adapters (peft) instead of all weights; adapters are merged "
                                          "into the weights the engines load.")
    lora_r: int = Field(16, ge=1, description="LoRA rank.")
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha (scale = alpha / r).")
    lora_target_modules: list[LoraTarget] = Field(
        list(LORA_TARGETS), min_length=1, description="The projections that get LoRA adapters (every attention "
                                                      "and MLP projection by default).")
    lora_dropout: float = Field(
        0.0, ge=0, lt=1, description="LoRA dropout: must be 0. The engines sample with dropout off and the trainer scores "
                                     "the sampled tokens with dropout off too, so that its logprobs equal the engine's "
                                     "(a dropout in the scoring forward moved them by ~1.5 nats and corrupted the PPO "
                                     "ratio and the TIS weight); a dropout > 0 would never act, so it is refused.")
    routing_replay: bool = Field(
        False, description="Mixture-of-experts policies: every trainer forward that scores the sampled tokens (the "
                           "policy's, the old-logprob pass, the KL reference) forces each MoE layer to the experts "
                           "the engine chose for each token, gate weights still from the live router (routing "
                           "replay, R3: Ma et al. 2025, arXiv:2510.11370; app/engines/routing.py). Needs an MoE model "
                           "and an engine that returns routed experts (the embedded engine; vLLM started with "
                           "--enable-return-routed-experts); run creation refuses it otherwise. A chain recorded "
                           "without routes is left out of the step, counted as 'no routed experts' in "
                           "merge.rejected_reasons; malformed routes fail the step naming the chain.")
    seed: int = Field(0, description="Seed for torch (dropout, LoRA init).")

    @field_validator("off_policy_correction", mode="before")
    @classmethod
    def _correction_names(cls, value):
        """One name stands for a list of one; an unknown name is refused naming the known ones."""
        names = [value] if isinstance(value, str) else value
        if isinstance(names, list):
            unknown = [n for n in names if isinstance(n, str) and n not in OFF_POLICY_CORRECTIONS]
            if unknown:
                raise ValueError(f"unknown correction {unknown[0]!r}; choose from {', '.join(OFF_POLICY_CORRECTIONS)}")
        return names

    @model_validator(mode="after")
    def _check_correction(self) -> "TrainingConfig":
        chosen = self.off_policy_correction
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"off_policy_correction: {chosen} names a correction twice")
        if "none" in chosen and len(chosen) > 1:
            raise ValueError("off_policy_correction: 'none' cannot be combined with another correction")
        if sum(c in CORRECTION_WEIGHTS for c in chosen) > 1:
            raise ValueError("off_policy_correction: choose one weight, 'token_tis' or 'seq_tis', not both")
        fields = type(self).model_fields
        for name, mode in (("seq_is_cap", "seq_tis"), ("seq_mis_bounds", "seq_mis"), ("geo_mask_bounds", "geo_mask"),
                           ("icepop_bounds", "icepop")):
            value = getattr(self, name)
            if isinstance(value, list) and not (0 <= value[0] <= 1 <= value[1]):
                # ratio 1 (trainer == rollout) must be kept, or an on-policy step would train nothing
                raise ValueError(f"{name}: {value} must hold 1 ([lo, hi] with 0 <= lo <= 1 <= hi)")
            # (a stored config holds every field, so the default must pass; another value is an intent)
            if value != fields[name].default and mode not in chosen:
                raise ValueError(f"{name}: used only with off_policy_correction {mode!r} (it holds {chosen})")
        return self

    @property
    def correction_masks(self) -> tuple[str, ...]:
        """The masks among `off_policy_correction` (their tokens leave the loss)."""
        return tuple(c for c in self.off_policy_correction if c in CORRECTION_MASKS)

    @model_validator(mode="after")
    def _no_scoring_dropout(self) -> "TrainingConfig":
        if self.lora_dropout > 0:
            raise ValueError(f"lora_dropout: {self.lora_dropout} is refused, use 0. The trainer scores sampled tokens "
                             "with dropout off, as the engines sampled them, so that its logprobs equal the engine's; "
                             "a LoRA dropout would never act")
        return self

    @model_validator(mode="after")
    def _check_teacher(self) -> "TrainingConfig":
        if self.algorithm != "grpo" and self.teacher is None:
            raise ValueError(f"teacher: algorithm {self.algorithm!r} needs a teacher (checkpoint or name)")
        if self.algorithm == "grpo" and self.teacher is not None:
            raise ValueError("teacher: a teacher is used only with algorithm 'opd' or 'grpo+opd'")
        if self.algorithm == "grpo" and self.opd_baseline != "none":
            raise ValueError("opd_baseline: a distillation baseline is used only with algorithm 'opd' or 'grpo+opd'")
        if self.algorithm == "grpo" and self.opd_divergence != "sampled_reverse_kl":
            raise ValueError("opd_divergence: a distillation divergence is used only with algorithm 'opd' or 'grpo+opd'")
        # (a stored config holds every field, so the default must pass; another value is an intent)
        if self.opd_topk != type(self).model_fields["opd_topk"].default and self.opd_divergence != "topk_forward_kl":
            raise ValueError("opd_topk: the teacher's top-k is used only with opd_divergence 'topk_forward_kl'")
        if self.opd_divergence == "topk_forward_kl" and self.opd_baseline != "none":
            raise ValueError("opd_baseline: the step-mean baseline is one of the sampled-token advantage; "
                             "opd_divergence topk_forward_kl has no advantage to centre")
        return self

    @property
    def opd_top(self) -> int:
        """Teacher tokens to store per sampled position: `opd_topk` under topk_forward_kl, else 0."""
        return self.opd_topk if self.opd_divergence == "topk_forward_kl" else 0

    def to_dict(self) -> dict:
        """The settings as a JSON-ready dict (every field, defaults included)."""
        return self.model_dump(mode="json")


class RunSeries(BaseModel):
    """The runs one command made together, so their pages link to each other: `turnstile learn`'s
    held-out eval `before`, the `train` run, and the eval `after` of its checkpoint."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["learn"] = "learn"
    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                    description="shared by every run of the series")
    role: Literal["before", "train", "after"]


class EvalOf(BaseModel):
    """What a held-out eval made by a train run's `eval_every` evaluates: that run's policy after
    `step` updates (the engines as that run left them; the last one loads its newest checkpoint)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    run: int = Field(ge=1, description="the train run whose policy is evaluated")
    step: int = Field(ge=0, description="policy updates the train run had made when the eval was made")


class RunConfig(BaseModel):
    """Everything a run needs; stored verbatim (after defaults) in `runs.config`."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["train", "eval", "collect", "tinker"] = Field(
        "train", description="tinker: a Tinker service model (a LoRA tenant its SDK client trains; app.tinker makes "
                             "them, not POST /api/runs)")
    task_set: str = Field("synthetic", min_length=1, max_length=4096,
                          description="a named set or a path inside an allowed folder (see README)")
    instances: list[Annotated[str, Field(min_length=1, max_length=255)]] | None = Field(
        None, min_length=1, max_length=100_000, description="subset of instance ids (default: all)")
    harness: str = "mini-swe-agent"
    runtime: RuntimeKind = Field(
        "auto", description="where episodes and grades run: 'local' (a working copy and venv on the host), 'oci' "
                            "(the instance's container image, rootless: skopeo + umoci + bubblewrap), 'docker' or "
                            "'podman' (the image through that engine), or 'auto': 'oci' for an instance that names "
                            "an image, else 'local'")
    model: ModelChoice = Field(default_factory=ModelChoice)
    group_size: int = Field(4, ge=1, le=1024, strict=True)
    tasks_per_step: int = Field(2, ge=1, le=1024, strict=True)
    steps: int = Field(2, ge=0, le=100000, strict=True)
    mode: Literal["sync", "async"] = "async"
    timeouts: Timeouts = Field(default_factory=Timeouts)
    budget: Budget = Field(default_factory=Budget)
    scheduling: Scheduling = Field(default_factory=Scheduling)
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="GRPO trainer settings")
    simulate: Simulation | None = None
    series: RunSeries | None = Field(None, description="the series of runs this one belongs to (set by "
                                                       "`turnstile learn`: before, train, after)")
    priority: int = Field(0, ge=0, le=9, description="higher runs first on shared queues (eval runs default to 5)")
    eval_every: int | None = Field(
        None, ge=1, le=100000, strict=True,
        description="train runs: evaluate the current policy on `eval_instances` after every this many steps (and "
                    "before the first and after the last), each time as an eval run of its own on the same engines, "
                    "while training goes on; the run page and TensorBoard (heldout/*) plot its pass@1 per step")
    eval_instances: list[Annotated[str, Field(min_length=1, max_length=255)]] | Annotated[
        str, Field(min_length=3, max_length=4096)] | None = Field(
        None, description="the held-out instances of `eval_every`: instance ids of the run's task set, or a split "
                          "spec 'SET:SPLIT' / 'SET:SPLIT@SEED' of it (e.g. 'family:heldout')")
    eval_samples: int = Field(1, ge=1, le=64, strict=True, description="samples per held-out instance of `eval_every`")
    eval_first: bool = Field(True, strict=True, description="with `eval_every`: evaluate at step 0 too (false when "
                                                            "the starting policy is evaluated by a run of its own, "
                                                            "as `turnstile learn` does)")
    eval_of: EvalOf | None = Field(None, description="set on the eval runs that `eval_every` makes")
    splice_history: bool = Field(
        True, strict=True,
        description="Token-in splicing at the gateway: an assistant turn the harness sends back that is one of the "
                    "episode's recorded answers is rendered as the exact ids the policy sampled (plus the template's "
                    "glue), not re-rendered from the harness's text, so the model sees exactly what it sampled "
                    "(reasoning a template would drop from history included) and prefix merging keeps one chain "
                    "even for harnesses that re-serialize their history. false: every turn is rendered from text.")

    @model_validator(mode="after")
    def _check_distillation(self) -> "RunConfig":
        if self.training.algorithm != "grpo" and self.scheduling.dynamic_sampling:
            # Groups whose rewards are all equal have no GRPO signal but still the teacher's.
            raise ValueError("scheduling.dynamic_sampling: with training.algorithm "
                             f"{self.training.algorithm!r} every group carries the teacher's signal; do not set "
                             "uniform-reward groups aside")
        return self

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        # Every problem at once, one "field: message" per line (the API reports each line as a detail).
        problems = []
        if self.harness not in HARNESSES:
            close = difflib.get_close_matches(self.harness, HARNESSES, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(f"harness: unknown harness {self.harness!r}; {hint}choose one of {', '.join(HARNESSES)}")
        if self.kind == "tinker" and not self.training.lora:
            problems.append("training.lora: a Tinker model is a LoRA tenant; set it true")
        if self.kind == "train" and self.steps < 1:
            problems.append(f"steps: a train run needs at least one step, got {self.steps}")
        if self.kind == "train" and self.group_size < 2 and self.training.algorithm != "opd":
            problems.append(f"group_size: GRPO needs at least 2 episodes per group for a train run, got {self.group_size}")
        if self.kind == "train" and (self.model.checkpoint or "").startswith("run:"):
            # 'run:<id>' means that run's newest checkpoint, which moves while it trains; the trainer
            # (re)loads its start weights at every restore, so they must not change under it.
            problems.append(f"model.checkpoint: a train run starts from a fixed checkpoint folder "
                            f"(var/runs/<id>/checkpoints/step_<k>/model), not {self.model.checkpoint!r}")
        if self.eval_every is not None and self.kind != "train":
            problems.append(f"eval_every: only a train run evaluates during training, not a {self.kind} run")
        if self.eval_every is not None and not self.eval_instances:
            problems.append("eval_instances: eval_every needs the held-out instances (ids or a split such as "
                            "'family:heldout')")
        if self.eval_instances and self.eval_every is None:
            problems.append("eval_every: eval_instances are evaluated every eval_every steps; set it")
        if self.eval_of is not None and self.kind != "eval":
            problems.append(f"eval_of: only an eval run evaluates another run's policy, not a {self.kind} run")
        if self.model.engine == "vllm" and not self.model.engine_urls:
            problems.append("model.engine_urls: a vllm model needs at least one engine URL")
        if problems:
            raise ValueError("\n".join(problems))
        return self
