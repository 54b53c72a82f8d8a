"""Training configuration: one dataclass, every field with help text, validated on creation.

Follows TRL's `GRPOConfig` habit (../shared/research/aesthetics.md §E): `metadata={"help": …}`
on each field and `__post_init__` raising `ValueError` messages that say what to change.
A run stores these fields under `Run.config["training"]`; `TrainingConfig.from_dict` builds
the object and rejects unknown keys.

Parameters that control the update: learning_rate, weight_decay, adam_beta1/2,
max_grad_norm, micro_batch_tokens, gradient_accumulation_steps.
Parameters that control the GRPO objective: advantage_mode, normalize_advantage_std,
clip_low, clip_high, tis_cap, kl_coef, loss_aggregation.
Parameters that control the data: builder.
Parameters that control the model: lora, lora_r, lora_alpha, lora_dropout, seed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from app.training.grpo import ADVANTAGE_MODES, LOSS_AGGREGATIONS
from app.training.trajectories import BUILDERS


@dataclass
class TrainingConfig:
    """GRPO trainer settings (see the module docstring for the groups)."""

    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW learning rate (Polar uses 1e-6, constant)."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW decoupled weight decay."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the global gradient norm to this (0 = no clipping)."})
    micro_batch_tokens: int = field(
        default=8192,
        metadata={"help": "Token budget of one micro-batch, padding included (rows x longest row). "
                  "A single sequence longer than this gets a micro-batch of its own."},
    )
    gradient_accumulation_steps: int | None = field(
        default=None,
        metadata={"help": "Micro-batches accumulated per optimizer update. None: all micro-batches "
                  "of a step accumulate into one update (on-policy). A number k splits the step into "
                  "several updates; later ones are off-policy and the PPO clip applies to them."},
    )
    advantage_mode: str = field(default="mean", metadata={"help": f"Group baseline: one of {ADVANTAGE_MODES}."})
    normalize_advantage_std: bool = field(default=True, metadata={"help": "Divide advantages by the group's reward std."})
    clip_low: float = field(default=0.2, metadata={"help": "PPO clip range below 1 (ratio >= 1 - clip_low)."})
    clip_high: float = field(default=0.28, metadata={"help": "PPO clip range above 1 (DAPO clip-higher)."})
    tis_cap: float | None = field(
        default=2.0, metadata={"help": "Cap C of the truncated importance weight trainer/rollout (None disables TIS)."}
    )
    kl_coef: float = field(default=0.0, metadata={"help": "Weight of the k3 KL penalty to the initial policy (0 = off)."})
    loss_aggregation: str = field(default="token", metadata={"help": f"Loss mean: one of {LOSS_AGGREGATIONS}."})
    builder: str = field(default="prefix_merging", metadata={"help": f"Trajectory builder: one of {BUILDERS}."})
    lora: bool = field(default=False, metadata={"help": "Train LoRA adapters (peft) instead of all weights; "
                                                      "adapters are merged into the weights the engines load."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    seed: int = field(default=0, metadata={"help": "Seed for torch (dropout, LoRA init)."})

    def __post_init__(self) -> None:
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0 disables clipping), got {self.max_grad_norm}")
        if self.micro_batch_tokens < 16:
            raise ValueError(f"micro_batch_tokens must be >= 16, got {self.micro_batch_tokens}")
        if self.gradient_accumulation_steps is not None and self.gradient_accumulation_steps < 1:
            raise ValueError("gradient_accumulation_steps must be >= 1, or None for one update per step")
        if self.advantage_mode not in ADVANTAGE_MODES:
            raise ValueError(f"advantage_mode must be one of {ADVANTAGE_MODES}, got {self.advantage_mode!r}")
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ValueError(f"tis_cap must be >= 1 (or None to disable TIS), got {self.tis_cap}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.loss_aggregation not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_aggregation must be one of {LOSS_AGGREGATIONS}, got {self.loss_aggregation!r}")
        if self.builder not in BUILDERS:
            raise ValueError(f"builder must be one of {BUILDERS}, got {self.builder!r}")
        if self.lora and (self.lora_r < 1 or self.lora_alpha < 1):
            raise ValueError("lora_r and lora_alpha must be >= 1 when lora is on")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")

    @classmethod
    def from_dict(cls, values: dict | None) -> "TrainingConfig":
        """Build from a JSON dict (e.g. `Run.config["training"]`); unknown keys raise ValueError."""
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown training option(s) {unknown}; known options: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
