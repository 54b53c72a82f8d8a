"""The GRPO trainer: a resident policy + optimizer that turns step sequences into one update.

Implements the objective of `app.training.grpo` (GRPO with DAPO clip-higher, token-level
aggregation by default, TIS against the rollout logprobs, optional KL penalty to the initial
policy: k3 or k2, `TrainingConfig.kl_estimator`).  One call of `Trainer.update` is one training step:

    length check: no sequence beyond max_sequence_tokens (raises before any forward)
    micro-batches (packed or padded, token budget)  app.training.batching
    ├─ [several updates, or an off-policy mask] no-grad pass: old logprobs for every
    │  micro-batch; masks re-weight the step over its kept tokens  app.training.correction
    └─ per update: forward → loss → backward per micro-batch (gradient accumulation),
       clip the global grad norm, AdamW step

With the default single update per step the pre-update logprobs are the forward pass's own
detached values (ratio = 1, the PPO clip is inactive, the off-policy weight still re-weights);
the first forward is also where the trainer-vs-rollout logprob gap is measured.
Checkpoints (`save`/`load`) hold the weights the engines load and the optimizer state.

Memory per token: no KV cache in training forwards, the LM head only at sampled positions in
chunks (`policy.token_logprobs`), and activation checkpointing of the decoder layers
(`TrainingConfig.activation_checkpointing`, on by default on CUDA).

Several processes (`torchrun`, `app.training.distributed`): the model is sharded with FSDP2;
rank 0 leads (its method calls are broadcast and replayed by the other ranks in `follow`),
the step's micro-batches are dealt round-robin to the ranks, and the metrics are reduced
over all ranks, so a step equals the single-process step up to float summation order.
"""
from __future__ import annotations

import copy
import gc
import json
import math
import os
import time
from pathlib import Path

import torch

from app.training import correction, distributed, head, memory, packing, policy
from app.training.batching import (MicroBatch, StepSequence, make_micro_batches, padding_fraction,
                                   zero_advantage_indices)
from app.runconfig import TrainingConfig
from app.training.grpo import policy_loss
from app.training.opd import apply_token_advantages, topk_forward_kl

OPTIMIZER_FILE = "optimizer.pt"
ADAPTER_FILE = "adapter.pt"
ENGINE_ADAPTER_DIR = "adapter"  # what engines serve per request (the embedded and the PEFT layout, for vLLM)
MODEL_DIR = "model"


# Attention implementations whose kernels take packed rows without a dense mask (cu_seqlens or
# block-sparse masks derived from position ids).
VARLEN_ATTENTION = ("flash_attention", "flex_attention")


class SequenceTooLongError(ValueError):
    """A training sequence is longer than the trainer accepts (`max_sequence_tokens`)."""


class Trainer:
    """A policy and its AdamW optimizer, resident for the life of a gpu worker process.

    `model` is a `*ForCausalLM` (fp32) already on its device; with `config.lora` it is wrapped
    with peft adapters here.  `vocab_size` bounds valid token ids (defaults to the
    embedding's row count); `pad_id` fills padded positions.  `group` (a
    `distributed.RankGroup`): shard the model with FSDP2 over that group (every rank builds the
    same model); None trains in this process alone.
    Raises ValueError for LoRA under FSDP (not supported).
    """

    def __init__(self, config: TrainingConfig, model, pad_id: int = 0, group: distributed.RankGroup | None = None):
        self.config = config
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.pad_id = pad_id
        self.group = group
        self.world = group.world if group is not None else 1
        self.position_limit = getattr(model.config, "max_position_embeddings", None)
        torch.manual_seed(config.seed)
        if config.lora:
            if group is not None:
                raise ValueError("training.lora: LoRA adapters are not trained under FSDP; use one process")
            model = policy.add_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout,
                                    config.lora_target_modules)
        self.model = model
        self.model.train()
        # Score with dropout off, as the engines sample (TrainingConfig refuses lora_dropout > 0;
        # a checkpoint's config may still carry attention dropout).
        policy.disable_dropout(self.model)
        lm_config = policy.causal_lm(model).config
        attention = getattr(lm_config, "_attn_implementation", None) or ""
        if (config.packing is not False and self.device.type == "cuda" and attention == "sdpa"
                and packing.flex_attention_available()):
            # flex attention skips the blocks across packed documents (sdpa would compute them)
            policy.causal_lm(model).set_attn_implementation("flex_attention")
            attention = "flex_attention"
        self.attention = attention
        self.shape = memory.Shape.of(lm_config)
        self._apply_settings(config)
        self._mask_cache: tuple | None = None
        # The KL reference is the initial policy: the adapters switched off under LoRA,
        # a frozen copy otherwise (memory: one more set of weights).
        self.reference = None
        if config.kl_coef > 0 and not config.lora:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.forward = policy.TokenLogprobs(self.model)
        self.reference_forward = policy.TokenLogprobs(self.reference) if self.reference is not None else None
        if group is not None:
            distributed.shard(self.forward, policy.causal_lm(self.model).model.layers, group)
            if self.reference_forward is not None:
                distributed.shard(self.reference_forward, self.reference.model.layers, group)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.weight_decay,
        )

    def _apply_settings(self, config: TrainingConfig) -> None:
        """Take `config`'s per-run settings: the length limit, packing and checkpointing."""
        self.config = config
        limit = config.max_sequence_tokens or self.position_limit
        self.max_sequence_tokens = int(limit) if limit else None
        self.limit_source = "training.max_sequence_tokens" if config.max_sequence_tokens else "the model's max_position_embeddings"
        self.packing = self.attention.startswith(VARLEN_ATTENTION) if config.packing is None else config.packing
        checkpointing = config.activation_checkpointing
        # None: chosen per step by the memory model where memory binds (CUDA, or a budget given).
        self.checkpointing_auto = checkpointing is None and (
            self.device.type == "cuda" or config.activation_memory_gib is not None)
        self.activation_checkpointing = bool(checkpointing)
        self.plan: memory.Plan | None = None
        policy.set_activation_checkpointing(self.model, self.activation_checkpointing)

    def use_config(self, config: TrainingConfig) -> None:
        """Train with another run's settings on the same model (a LoRA tenant, `app.training.tenants`):
        the per-run settings and AdamW's learning rate, betas and weight decay.  The model-shaping
        fields (LoRA rank, alpha, targets) and the seed were fixed when the trainer was built.
        Checkpointing is re-applied only when its settings differ (transformers' checkpointing
        switch walks every module: ~60 ms on SmolLM2, most of a tenant swap)."""
        fields = ("max_sequence_tokens", "packing", "activation_checkpointing", "activation_memory_gib")
        if all(getattr(config, f) == getattr(self.config, f) for f in fields):
            self.config = config  # same per-run settings: limits, packing and the checkpointing plan stay
        else:
            self._apply_settings(config)
        for group in self.optimizer.param_groups:
            group.update(lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                         weight_decay=config.weight_decay)

    @classmethod
    def from_spec(cls, config: TrainingConfig, spec: str, device: torch.device | None = None) -> "Trainer":
        """Load the policy `spec` ("tiny" | "smollm2" | checkpoint dir) on `device` (CUDA if present).

        In a process group of several ranks (`distributed.current()`), the model is sharded
        over the group on this rank's device; rank 0 first tells the other ranks (waiting in
        `follow`) to build the same trainer.
        """
        group = distributed.current()
        if group is not None:
            if group.leader:
                group.broadcast_object(("build", (config.to_dict(), spec)))
            device = distributed.device(group)
        device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model, _vocab = policy.load_policy(spec, device)
        return cls(config, model, pad_id=int(model.config.pad_token_id or 0), group=group)

    def _lead(self, method: str, *args) -> None:
        """On rank 0 of a group, have the other ranks (in `follow`) call `method(*args)` too."""
        if self.group is not None and self.group.leader:
            self.group.broadcast_object((method, args))

    def check_lengths(self, sequences: list[StepSequence]) -> None:
        """Raise `SequenceTooLongError` naming the length and the limit when a trainable
        sequence is longer than `max_sequence_tokens` (checked before any model work)."""
        if self.max_sequence_tokens is None:
            return
        too_long = [s for s in sequences if s.trainable > 0 and len(s.token_ids) > self.max_sequence_tokens]
        if too_long:
            worst = max(too_long, key=lambda s: len(s.token_ids))
            raise SequenceTooLongError(
                f"a training sequence of {len(worst.token_ids)} tokens (episode {worst.episode_id}) is longer than "
                f"the limit of {self.max_sequence_tokens} tokens ({self.limit_source}); {len(too_long)} of "
                f"{len(sequences)} sequences exceed it. Raise training.max_sequence_tokens if the device's memory "
                f"allows (activation checkpointing lowers memory per token), or cap the episodes' context")

    # --- logprobs ----------------------------------------------------------------------

    def _mask(self, mb: MicroBatch):
        """The attention mask of `mb`: its padding mask, or for a packed row the document mask
        (`app.training.packing`; flash-attention derives it from the position ids itself)."""
        if mb.segment_lengths is None or self.attention.startswith("flash"):
            return mb.attention_mask
        key = (mb.segment_lengths, mb.input_ids.device)
        if self._mask_cache is None or self._mask_cache[0] != key:
            self._mask_cache = (key, packing.document_mask(mb.segment_lengths, self.attention, mb.input_ids.device))
        return self._mask_cache[1]

    def _logprobs(self, mb: MicroBatch, grad: bool, top: bool = False):
        """The sampled tokens' logprobs [N]; with `top` and the teacher's top-k in `mb`, the triple
        (that, the student's logprobs of the teacher's k tokens [N, k], log of its mass outside
        them [N])."""
        extra = mb.teacher_top_ids if top else None
        with torch.set_grad_enabled(grad), policy.autocast(self.device):
            # under the sampling transform each token was drawn with (identity: all None)
            return self.forward(mb.input_ids, self._mask(mb), mb.position_ids, mb.rows, mb.cols, mb.targets,
                                **mb.transform(), **({"extra_targets": extra} if extra is not None else {}))

    def _reference_logprobs(self, mb: MicroBatch) -> torch.Tensor | None:
        if self.config.kl_coef <= 0:
            return None
        with torch.no_grad(), policy.autocast(self.device):
            args = (mb.input_ids, self._mask(mb), mb.position_ids, mb.rows, mb.cols, mb.targets)
            if self.config.lora:
                with self.model.disable_adapter():
                    return self.forward(*args, **mb.transform())
            return self.reference_forward(*args, **mb.transform())

    def logprobs(self, sequences: list[StepSequence]) -> list[torch.Tensor]:
        """Trainer logprobs (float32 [trainable tokens], CPU) of each sequence's sampled tokens, no grad.

        Raises `SequenceTooLongError` as `update` does.  Under FSDP every rank computes all of them.
        """
        self._lead("logprobs", sequences)
        self.check_lengths(sequences)
        out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
        for mb in make_micro_batches(sequences, self.config.micro_batch_tokens, "token", self.pad_id, self.packing):
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
        tis_truncated_fraction, ratio_mean, topk_forward_kl (distillation to a teacher's top-k:
        mean KL(q || student) per scored token, None without), logprob_gap_max_abs / logprob_gap_mean_abs
        (|trainer - rollout| before the update over the sampled tokens sampled by the trainer's
        own weights, lag 0: the sampling-vs-training mismatch alone), logprob_gap_stale_max_abs /
        logprob_gap_stale_mean_abs and tokens_stale (the same over tokens sampled by older
        weights, `MicroBatch.token_lag` > 0: the mismatch plus the policy's change since, which
        the off-policy correction corrects; each gap None when the step had no such token),
        off_policy (`app.training.correction.CorrectionStats.metrics`: shares of tokens and chains
        masked, ratio quantiles, the weights' effective sample size, the gap by lag 0 / 1 / 2+;
        always, whatever the correction; tis_weight_mean and tis_truncated_fraction are those of
        the chosen weight, token or chain),
        micro_batches_zero_advantage (forward only: their gradient is exactly zero), grad_norm (largest
        pre-clip norm), tokens_trained, tokens_processed (real tokens through the model),
        padded_tokens, sequences, micro_batches, optimizer_updates, update_time_s,
        activation_checkpointing, world_size.
        Raises `SequenceTooLongError` before any forward pass (see `check_lengths`).
        """
        self._lead("update", sequences)
        start = time.perf_counter()
        cfg = self.config
        self.check_lengths(sequences)
        # Chains with advantage 0 everywhere add exactly 0 to the loss and its gradient: with one update
        # per step and no KL term they are left out before any forward pass (`skip_zero_advantage`).
        # A mask must see every chain: it may drop their tokens from the denominator.
        masking = correction.needs_masks_first(cfg)
        skip = (zero_advantage_indices(sequences) if cfg.skip_zero_advantage and cfg.kl_coef == 0
                and not cfg.gradient_accumulation_steps and not masking else set())
        batches = make_micro_batches(sequences, cfg.micro_batch_tokens, cfg.loss_aggregation, self.pad_id, self.packing,
                                     leave_out=skip)
        batches = apply_token_advantages(batches, sequences)  # on-policy distillation: A_t per token
        if correction.sequence_level(cfg):
            correction.check_whole_chains(batches, sequences)
        for mb in batches:
            if mb.teacher_top_ids is not None and int(mb.teacher_top_ids.max()) >= self.shape.vocab:
                raise ValueError(f"the teacher's top-k holds token id {int(mb.teacher_top_ids.max())}, outside the "
                                 f"student's vocabulary of {self.shape.vocab} (a teacher with a larger LM head)")
        metrics = {
            "sequences": sum(1 for s in sequences if s.trainable > 0),
            "micro_batches": len(batches),
            "tokens_trained": int(sum(mb.targets.numel() for mb in batches)),
            "tokens_processed": int(sum(mb.tokens for mb in batches)),
            "padded_tokens": int(sum(mb.padded_tokens for mb in batches)),
            "padding_fraction": padding_fraction(batches),
            "longest_micro_batch_tokens": max((mb.padded_tokens for mb in batches), default=0),
            **self._plan_checkpointing(batches),
            "packing": self.packing,
            "world_size": self.world,
            "sequences_zero_advantage_skipped": sum(1 for i in skip if sequences[i].trainable > 0),
        }
        if not batches:
            return {**metrics, "optimizer_updates": 0, "loss": 0.0, "update_time_s": time.perf_counter() - start}
        per_update = cfg.gradient_accumulation_steps or len(batches)
        chunks = [batches[i : i + per_update] for i in range(0, len(batches), per_update)]
        shares = [self._share(chunk) for chunk in chunks]
        # With several updates per step, later updates see moved weights: their PPO ratio
        # needs logprobs from before the first update, so compute them all first.  A mask
        # needs them too: masked tokens leave the step's denominator (app.training.correction).
        old = ([[self._logprobs(mb, grad=False).float() for mb, _real in share] for share in shares]
               if len(chunks) > 1 or masking else None)
        gaps = ([_gap(o, mb) for olds, share in zip(old, shares)
                 for o, (mb, real) in zip(olds, share) if real] if old else [])
        stats_off = correction.CorrectionStats()
        # per update and micro-batch of this rank's share its TokenCorrection; with masks, per
        # update its sum of weights over the kept tokens of all ranks
        fixes, update_weights = (correction.correct_all(old, shares, sequences, cfg, stats_off, self.group)
                                 if old is not None else (None, None))
        totals = {"loss": 0.0, "clipped": 0.0, "kl": 0.0, "tis": 0.0, "tis_truncated": 0.0, "ratio": 0.0,
                  "topk_kl": 0.0, "topk_tokens": 0.0}
        grad_norm = 0.0
        skipped = nonfinite = 0
        for u, (chunk, share) in enumerate(zip(chunks, shares)):
            self.optimizer.zero_grad(set_to_none=True)
            # Each update is the aggregated mean over its own micro-batches.
            # (with chains left out, the whole step's weights, which sum to 1, are still the denominator)
            if update_weights is not None:  # over the kept tokens (0: all of this update is masked)
                scale = 1.0 / update_weights[u] if update_weights[u] > 0 else 0.0
            else:
                scale = 1.0 if skip else 1.0 / float(sum(mb.weights.sum() for mb in chunk))
            for j, ((mb, real), backward) in enumerate(zip(share, self._needs_backward(share))):
                if not backward:
                    # Zero advantage and no KL: this micro-batch's loss and gradient are exactly
                    # zero, so skip the backward pass; the forward pass still measures the gap.
                    if old is None:
                        values = self._logprobs(mb, grad=False).float()
                        if real:
                            gaps.append(_gap(values, mb))
                            stats_off.add(correction.token_correction(values, mb.rollout_logprobs, mb.sequence_index,
                                                                      cfg), mb)
                    skipped += int(real)
                    continue
                top_logprobs = None
                if mb.teacher_top_ids is not None:  # distillation to the teacher's top-k (app.training.opd)
                    logprobs, top_logprobs, top_log_rest = self._logprobs(mb, grad=True, top=True)
                    logprobs = logprobs.float()
                else:
                    logprobs = self._logprobs(mb, grad=True).float()
                if fixes is not None:
                    fix = fixes[u][j]
                else:  # one update, no mask: old is this forward's own detached logprobs
                    fix = correction.token_correction(logprobs.detach(), mb.rollout_logprobs, mb.sequence_index, cfg)
                    if real:
                        gaps.append(_gap(logprobs.detach(), mb))
                        stats_off.add(fix, mb)
                loss, stats = policy_loss(
                    logprobs,
                    old[u][j] if old is not None else logprobs.detach(),
                    mb.rollout_logprobs,
                    mb.advantages,
                    mb.weights * (scale if real else 0.0),
                    clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high,
                    tis_cap=cfg.tis_cap,
                    ref_logprobs=self._reference_logprobs(mb),
                    kl_coef=cfg.kl_coef,
                    kl_estimator=cfg.kl_estimator,
                    correction=fix,
                )
                if top_logprobs is not None:
                    topk_kl = topk_forward_kl(top_logprobs, top_log_rest, mb.teacher_top_logprobs, mb.teacher_top_rows)
                    loss = loss + cfg.opd_coef * (topk_kl * mb.weights * (scale if real else 0.0)).sum()
                    if real:
                        totals["topk_kl"] += float(topk_kl.detach().sum())
                        totals["topk_tokens"] += float(mb.teacher_top_rows.sum())
                # FSDP averages gradients over the ranks, but each rank's loss is its share of
                # the step's sum: scale by the world size so the gradient is the sum's.
                (loss * self.world).backward()
                if not (real and (cfg.kl_coef > 0 or bool(mb.advantages.any()) or top_logprobs is not None)):
                    continue  # a filler, or one only run for the other ranks: stats as if skipped
                totals["loss"] += loss.item() / len(chunks)
                totals["clipped"] += stats.clipped
                totals["kl"] += stats.kl
                totals["tis"] += stats.tis_weight
                totals["tis_truncated"] += stats.tis_truncated
                totals["ratio"] += stats.ratio
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            norm = distributed.grad_norm_value(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
            if not math.isfinite(norm):
                # A NaN or infinite loss or gradient: skip this update (weights and AdamW state
                # stay as they were, the step counter too) rather than poison the moments.
                nonfinite += 1
                continue
            grad_norm = max(grad_norm, norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        gap = torch.cat([g for g, _ in gaps]) if gaps else torch.zeros(0)
        stale = torch.cat([m for _, m in gaps]) if gaps else torch.zeros(0, dtype=torch.bool)
        fresh_gap, stale_gap = gap[~stale.to(gap.device)], gap[stale.to(gap.device)]
        gap_max = float(fresh_gap.max()) if fresh_gap.numel() else 0.0
        stale_max = float(stale_gap.max()) if stale_gap.numel() else 0.0
        gap_sum, gap_count = float(fresh_gap.sum()), fresh_gap.numel()
        stale_sum, stale_count = float(stale_gap.sum()), stale_gap.numel()
        if self.group is not None:
            keys = list(totals)
            summed = self.group.all_reduce(torch.tensor([totals[k] for k in keys]
                                                        + [gap_sum, gap_count, stale_sum, stale_count, skipped]))
            totals = dict(zip(keys, summed[: len(keys)].tolist()))
            gap_sum, gap_count, stale_sum, stale_count, skipped = summed[len(keys):].tolist()
            gap_count, stale_count, skipped = int(gap_count), int(stale_count), int(skipped)
            gap_max, stale_max = self.group.all_reduce(torch.tensor([gap_max, stale_max]), op="max").tolist()
        n = max(metrics["tokens_trained"], 1)
        return _finite_or_none({
            **metrics,
            "loss": totals["loss"],
            "clip_fraction": totals["clipped"] / n,
            "kl": totals["kl"] / n,
            "tis_weight_mean": totals["tis"] / n,
            "tis_truncated_fraction": totals["tis_truncated"] / n,
            "ratio_mean": totals["ratio"] / n,
            # on-policy distillation to the teacher's top-k: mean KL(q || student) per scored token
            "topk_forward_kl": totals["topk_kl"] / totals["topk_tokens"] if totals["topk_tokens"] else None,
            # None where the step had no such token: a 0 would read as a perfect match
            "logprob_gap_max_abs": gap_max if gap_count else None,
            "logprob_gap_mean_abs": gap_sum / gap_count if gap_count else None,
            "logprob_gap_stale_max_abs": stale_max if stale_count else None,
            "logprob_gap_stale_mean_abs": stale_sum / stale_count if stale_count else None,
            "tokens_stale": stale_count,
            "off_policy": stats_off.metrics(self.group),
            "grad_norm": grad_norm,
            "optimizer_updates": len(chunks),
            "micro_batches_zero_advantage": skipped,
            "nonfinite_updates_skipped": nonfinite,
            "update_time_s": time.perf_counter() - start,
        })

    def _plan_checkpointing(self, batches: list[MicroBatch]) -> dict:
        """Pick this step's checkpointing from the memory model of its largest micro-batch
        (`app.training.memory`): a fixed `activation_checkpointing` is kept as set; None picks
        none / every k-th layer / full to fit the activation budget.  Returns its metrics."""
        if not batches:
            return {"activation_checkpointing": self.activation_checkpointing}
        largest = max(batches, key=lambda mb: mb.padded_tokens)
        dense = packing.dense_mask_elements(largest, self.attention)
        kwargs = {"act_bytes": 2 if self.device.type == "cuda" else 4, "resid_bytes": 4, "dense_mask": dense,
                  "head_chunk": min(head.chunk_positions(self.shape.vocab), largest.targets.numel())}
        if self.checkpointing_auto:
            plan = memory.plan_checkpointing(self.shape, largest.padded_tokens, self._activation_budget(), **kwargs)
            if self.plan is None or plan.layers != self.plan.layers:
                policy.set_checkpointed_layers(self.model, plan.layers)
        else:
            plan = memory.fixed_plan(self.shape, largest.padded_tokens, self.activation_checkpointing, **kwargs)
        self.plan = plan
        self.activation_checkpointing = bool(plan.layers)
        return {"activation_checkpointing": self.activation_checkpointing, "checkpointing": plan.mode,
                "checkpointed_layers": len(plan.layers),
                "activation_memory_predicted_gib": plan.predicted_bytes / 2**30}

    def _activation_budget(self) -> float:
        """Bytes the largest micro-batch's activations may take: `activation_memory_gib`, or on
        CUDA 85% of the free device memory less the gradients and AdamW state not yet allocated
        (the same on every rank: the smallest)."""
        if self.config.activation_memory_gib is not None:
            budget = float(memory.gib(self.config.activation_memory_gib))
        else:
            free, _total = torch.cuda.mem_get_info(self.device)
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            param_bytes = sum(p.numel() * p.element_size() for p in self.params)
            pending = (0 if all(p.grad is not None for p in self.params) else param_bytes) + \
                (0 if self.optimizer.state else 2 * param_bytes)
            budget = 0.85 * free - pending
        if self.group is not None:
            budget = -float(self.group.all_reduce(torch.tensor([-budget]), op="max")[0])
        return budget

    def _share(self, chunk: list[MicroBatch]) -> list[tuple[MicroBatch, bool]]:
        """This rank's micro-batches of one update, on its device, as `(micro-batch, real)`.

        Rank r takes micro-batches r, r + world, ...; ranks with one fewer get a copy of the
        update's first micro-batch with `real` False (its loss weights are zeroed), so every
        rank runs the same number of forward/backward passes, as FSDP's collectives require.
        Alone: every micro-batch, all real.
        """
        rank = self.group.rank if self.group is not None else 0
        mine = [(mb.to(self.device), True) for mb in chunk[rank :: self.world]]
        missing = math.ceil(len(chunk) / self.world) - len(mine)
        return mine + [(chunk[0].to(self.device), False)] * missing

    def _needs_backward(self, share: list[tuple[MicroBatch, bool]]) -> list[bool]:
        """Whether each position of this rank's share needs a backward pass: a real micro-batch
        with a nonzero advantage or a KL term.  Under FSDP, position j runs a backward on
        every rank as soon as one rank needs it (the same collectives on every rank)."""
        needed = [real and (self.config.kl_coef > 0 or bool(mb.advantages.any()) or mb.teacher_top_ids is not None)
                  for mb, real in share]
        if self.group is not None:
            needed = [v > 0 for v in self.group.all_reduce(torch.tensor(needed, dtype=torch.float64), op="max").tolist()]
        return needed

    # --- checkpoints -------------------------------------------------------------------

    def save(self, directory: Path, metadata: dict) -> None:
        """Write `directory`: `model/` (full weights, LoRA merged; what engines load),
        `optimizer.pt`, `adapter.pt` and `adapter/` (LoRA only; the latter in the engines'
        per-request adapter format) and `trainer_state.json` (`metadata`).
        The caller makes the directory visible atomically (see `app.training.checkpoints`).
        Under FSDP: `sharded/` (model + optimizer, torch.distributed.checkpoint) instead of
        `optimizer.pt`, and rank 0 writes `model/` from the gathered full weights; every rank
        must see `directory`.
        """
        self._lead("save", directory, metadata)
        directory.mkdir(parents=True, exist_ok=True)
        if self.group is not None:
            distributed.save_sharded(self.forward, self.optimizer, directory)
            state = distributed.full_state_dict(self.forward, self.group, prefix="policy.")
            if self.group.leader:
                distributed.export_safetensors(policy.causal_lm(self.model).config, state, directory / MODEL_DIR,
                                               {"policy_version": metadata.get("policy_version")})
                _write_json(directory / "trainer_state.json", metadata)
            self.group.barrier()
            return
        policy.save_policy_weights(self.model, directory / MODEL_DIR, {"policy_version": metadata.get("policy_version")})
        _save_torch(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)
        if self.config.lora:
            adapters = {k: v for k, v in self.model.state_dict().items() if "lora_" in k}
            _save_torch(adapters, directory / ADAPTER_FILE)
            # The same adapters in the engines' format (per-request LoRA: app.engines.embedded.adapters).
            from app.engines.embedded.adapters import peft_weights, save_adapter

            save_adapter(directory / ENGINE_ADAPTER_DIR, peft_weights(adapters), self.config.lora_r,
                         self.config.lora_alpha, metadata.get("policy_version"))
        _write_json(directory / "trainer_state.json", metadata)

    def load(self, directory: Path) -> dict:
        """Restore weights and optimizer state from a checkpoint `directory`; return its metadata.

        Under FSDP from `sharded/` (raises FileNotFoundError when absent)."""
        self._lead("load", directory)
        if self.group is not None:
            distributed.load_sharded(self.forward, self.optimizer, directory)
            return json.loads((directory / "trainer_state.json").read_text())
        if self.config.lora:
            try:
                adapters = torch.load(directory / ADAPTER_FILE, map_location=self.device)
            except Exception as exc:  # a truncated or overwritten file: name it and the cause
                raise ValueError(f"{directory / ADAPTER_FILE}: the LoRA adapter file cannot be read "
                                 f"({type(exc).__name__}: {exc})") from exc
            if not isinstance(adapters, dict):
                raise ValueError(f"{directory / ADAPTER_FILE}: not an adapter state dict ({type(adapters).__name__})")
            missing = set(adapters) - set(self.model.state_dict())
            if missing:
                raise ValueError(f"{directory}: adapter keys do not fit the model: {sorted(missing)[:3]}")
            self.model.load_state_dict(adapters, strict=False)
        else:
            policy.load_policy_weights(self.model, directory / MODEL_DIR)
        self.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, map_location=self.device))
        return json.loads((directory / "trainer_state.json").read_text())


def follow(group: distributed.RankGroup) -> None:
    """The loop of ranks other than 0: replay rank 0's trainer calls until it calls `stop`.

    Rank 0 broadcasts `("build", (config dict, spec))` from `Trainer.from_spec` and
    `(method, args)` from `update`, `logprobs`, `save` and `load`; this rank makes the same
    call on its own trainer (built here, the previous one dropped first).  An exception here
    propagates: the process exits and torchrun stops the group.
    """
    trainer = None
    while True:
        op, args = group.broadcast_object()
        if op == "stop":
            return
        if op == "build":
            trainer = None
            gc.collect()
            config, spec = args
            trainer = Trainer.from_spec(TrainingConfig.model_validate(config), spec)
        else:
            getattr(trainer, op)(*args)


def stop_followers(group: distributed.RankGroup | None) -> None:
    """On rank 0: release the other ranks from `follow`."""
    if group is not None and group.leader:
        group.broadcast_object(("stop", ()))


def _finite_or_none(metrics: dict) -> dict:
    """`metrics` with NaN / infinite floats as None (JSON and PostgreSQL's JSONB refuse them)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}


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


def _gap(logprobs: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """|trainer - rollout| logprob (float [N], nats) of micro-batch `mb`'s sampled tokens, and
    which of them were sampled by older weights (bool [N], `mb.token_lag` > 0)."""
    return (logprobs - mb.rollout_logprobs).abs(), mb.token_lag.to(logprobs.device) > 0
