"""The GRPO trainer: a resident policy + optimizer that turns step sequences into one update.

Implements the objective of `app.training.grpo` (GRPO with DAPO clip-higher, token-level
aggregation by default, TIS against the rollout logprobs, optional KL penalty to the initial
policy: k3 or k2, `TrainingConfig.kl_estimator`).  One call of `Trainer.update` is one training step:

    micro-batches (padded, token budget)            app.training.batching
    ├─ [several updates only] no-grad pass: old logprobs for every micro-batch
    └─ per update: forward → loss → backward per micro-batch (gradient accumulation),
       clip the global grad norm, AdamW step

With the default single update per step the pre-update logprobs are the forward pass's own
detached values (ratio = 1, the PPO clip is inactive, TIS still re-weights); the first
forward is also where the trainer-vs-rollout logprob gap is measured.
Checkpoints (`save`/`load`) hold the weights the engines load and the optimizer state.
"""
from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import torch

from app.training import policy
from app.training.batching import MicroBatch, StepSequence, make_micro_batches
from app.runconfig import TrainingConfig
from app.training.grpo import policy_loss

OPTIMIZER_FILE = "optimizer.pt"
ADAPTER_FILE = "adapter.pt"
MODEL_DIR = "model"


class Trainer:
    """A policy and its AdamW optimizer, resident for the life of a gpu worker process.

    `model` is a `*ForCausalLM` (fp32) already on its device; with `config.lora` it is wrapped
    with peft adapters here.  `vocab_size` bounds valid token ids (defaults to the
    embedding's row count); `pad_id` fills padded positions.
    """

    def __init__(self, config: TrainingConfig, model, pad_id: int = 0):
        self.config = config
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.pad_id = pad_id
        torch.manual_seed(config.seed)
        if config.lora:
            model = policy.add_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout)
        self.model = model
        self.model.train()
        # The KL reference is the initial policy: the adapters switched off under LoRA,
        # a frozen copy otherwise (memory: one more set of weights).
        self.reference = None
        if config.kl_coef > 0 and not config.lora:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.weight_decay,
        )

    @classmethod
    def from_spec(cls, config: TrainingConfig, spec: str, device: torch.device | None = None) -> "Trainer":
        """Load the policy `spec` ("tiny" | "smollm2" | checkpoint dir) on `device` (CUDA if present)."""
        device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model, _vocab = policy.load_policy(spec, device)
        return cls(config, model, pad_id=int(model.config.pad_token_id or 0))

    # --- logprobs ----------------------------------------------------------------------

    def _logprobs(self, mb: MicroBatch, grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad), policy.autocast(self.device):
            return policy.token_logprobs(self.model, mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.targets)

    def _reference_logprobs(self, mb: MicroBatch) -> torch.Tensor | None:
        if self.config.kl_coef <= 0:
            return None
        with torch.no_grad(), policy.autocast(self.device):
            if self.config.lora:
                with self.model.disable_adapter():
                    return policy.token_logprobs(self.model, mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.targets)
            return policy.token_logprobs(self.reference, mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.targets)

    def logprobs(self, sequences: list[StepSequence]) -> list[torch.Tensor]:
        """Trainer logprobs (float32 [trainable tokens], CPU) of each sequence's sampled tokens, no grad."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
        for mb in make_micro_batches(sequences, self.config.micro_batch_tokens, "token", self.pad_id):
            mb = mb.to(self.device)
            values = self._logprobs(mb, grad=False).float().cpu()
            index = mb.sequence_index.cpu()
            for i in index.unique().tolist():
                out[i] = values[index == i]
        return out

    # --- one step ----------------------------------------------------------------------

    def update(self, sequences: list[StepSequence]) -> dict:
        """Run one GRPO step over `sequences`; return its metrics (JSON-able floats and ints).

        Metrics: loss, clip_fraction, kl (mean k3 value, an estimate of KL(policy || ref), whichever estimator is in the loss; 0 when off), tis_weight_mean,
        tis_truncated_fraction, ratio_mean, logprob_gap_max_abs / logprob_gap_mean_abs,
        micro_batches_zero_advantage (forward only: their gradient is exactly zero)
        (|trainer - rollout| over sampled tokens before the update), grad_norm (largest
        pre-clip norm), tokens_trained, tokens_processed (real tokens through the model),
        padded_tokens, sequences, micro_batches, optimizer_updates, update_time_s.
        """
        start = time.perf_counter()
        cfg = self.config
        batches = [mb.to(self.device) for mb in make_micro_batches(sequences, cfg.micro_batch_tokens, cfg.loss_aggregation, self.pad_id)]
        metrics = {
            "sequences": sum(1 for s in sequences if s.trainable > 0),
            "micro_batches": len(batches),
            "tokens_trained": int(sum(mb.targets.numel() for mb in batches)),
            "tokens_processed": int(sum(mb.tokens for mb in batches)),
            "padded_tokens": int(sum(mb.padded_tokens for mb in batches)),
        }
        if not batches:
            return {**metrics, "optimizer_updates": 0, "loss": 0.0, "update_time_s": time.perf_counter() - start}
        per_update = cfg.gradient_accumulation_steps or len(batches)
        chunks = [batches[i : i + per_update] for i in range(0, len(batches), per_update)]
        # With several updates per step, later updates see moved weights: their PPO ratio
        # needs logprobs from before the first update, so compute them all first.
        old = [self._logprobs(mb, grad=False).float() for mb in batches] if len(chunks) > 1 else None
        gaps = [(o - mb.rollout_logprobs).abs() for o, mb in zip(old, batches)] if old else []
        totals = {"loss": 0.0, "clipped": 0.0, "kl": 0.0, "tis": 0.0, "tis_truncated": 0.0, "ratio": 0.0}
        grad_norm = 0.0
        index = 0
        skipped = 0
        for chunk in chunks:
            self.optimizer.zero_grad(set_to_none=True)
            # Each update is the aggregated mean over its own micro-batches.
            scale = 1.0 / float(sum(mb.weights.sum() for mb in chunk))
            for mb in chunk:
                if cfg.kl_coef == 0 and not bool(mb.advantages.any()):
                    # Zero advantage and no KL: this micro-batch's loss and gradient are exactly
                    # zero, so skip the backward pass; the forward pass still measures the gap.
                    if old is None:
                        gaps.append((self._logprobs(mb, grad=False).float() - mb.rollout_logprobs).abs())
                    skipped += 1
                    index += 1
                    continue
                logprobs = self._logprobs(mb, grad=True).float()
                if old is None:
                    gaps.append((logprobs.detach() - mb.rollout_logprobs).abs())
                loss, stats = policy_loss(
                    logprobs,
                    old[index] if old is not None else logprobs.detach(),
                    mb.rollout_logprobs,
                    mb.advantages,
                    mb.weights * scale,
                    clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high,
                    tis_cap=cfg.tis_cap,
                    ref_logprobs=self._reference_logprobs(mb),
                    kl_coef=cfg.kl_coef,
                    kl_estimator=cfg.kl_estimator,
                )
                loss.backward()
                totals["loss"] += loss.item() / len(chunks)
                totals["clipped"] += stats.clipped
                totals["kl"] += stats.kl
                totals["tis"] += stats.tis_weight
                totals["tis_truncated"] += stats.tis_truncated
                totals["ratio"] += stats.ratio
                index += 1
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
            grad_norm = max(grad_norm, float(norm))
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        gap = torch.cat(gaps)
        n = max(metrics["tokens_trained"], 1)
        return {
            **metrics,
            "loss": totals["loss"],
            "clip_fraction": totals["clipped"] / n,
            "kl": totals["kl"] / n,
            "tis_weight_mean": totals["tis"] / n,
            "tis_truncated_fraction": totals["tis_truncated"] / n,
            "ratio_mean": totals["ratio"] / n,
            "logprob_gap_max_abs": float(gap.max()),
            "logprob_gap_mean_abs": float(gap.mean()),
            "grad_norm": grad_norm,
            "optimizer_updates": len(chunks),
            "micro_batches_zero_advantage": skipped,
            "update_time_s": time.perf_counter() - start,
        }

    # --- checkpoints -------------------------------------------------------------------

    def save(self, directory: Path, metadata: dict) -> None:
        """Write `directory`: `model/` (full weights, LoRA merged; what engines load),
        `optimizer.pt`, `adapter.pt` (LoRA only) and `trainer_state.json` (`metadata`).
        The caller makes the directory visible atomically (see `app.training.checkpoints`).
        """
        directory.mkdir(parents=True, exist_ok=True)
        policy.save_policy_weights(self.model, directory / MODEL_DIR, {"policy_version": metadata.get("policy_version")})
        _save_torch(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)
        if self.config.lora:
            adapters = {k: v for k, v in self.model.state_dict().items() if "lora_" in k}
            _save_torch(adapters, directory / ADAPTER_FILE)
        _write_json(directory / "trainer_state.json", metadata)

    def load(self, directory: Path) -> dict:
        """Restore weights and optimizer state from a checkpoint `directory`; return its metadata."""
        if self.config.lora:
            adapters = torch.load(directory / ADAPTER_FILE, map_location=self.device)
            missing = set(adapters) - set(self.model.state_dict())
            if missing:
                raise ValueError(f"{directory}: adapter keys do not fit the model: {sorted(missing)[:3]}")
            self.model.load_state_dict(adapters, strict=False)
        else:
            policy.load_policy_weights(self.model, directory / MODEL_DIR)
        self.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, map_location=self.device))
        return json.loads((directory / "trainer_state.json").read_text())


def _save_torch(obj, path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
