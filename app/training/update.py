"""One GRPO training step on a resident `Trainer`: from step sequences to one optimizer update.

Implements the objective of `app.training.grpo` (GRPO with DAPO clip-higher, token-level
aggregation by default, TIS against the rollout logprobs, optional KL penalty to the initial
policy: k3 or k2, `TrainingConfig.kl_estimator`).  `run_update(trainer, sequences)` is what
`Trainer.update` runs:

    length check: no sequence beyond max_sequence_tokens (raises before any forward)
    micro-batches (packed or padded, token budget)  app.training.batching
    ├─ [several updates, or an off-policy mask] no-grad pass: old logprobs for every
    │  micro-batch; masks re-weight the step over its kept tokens  app.training.correction
    └─ per update: forward → loss → backward per micro-batch (gradient accumulation),
       clip the global grad norm, AdamW step

With the default single update per step the pre-update logprobs are the forward pass's own
detached values (ratio = 1, the PPO clip is inactive, the off-policy weight still re-weights);
the first forward is also where the trainer-vs-rollout logprob gap is measured.  Under FSDP
the step's micro-batches are dealt round-robin to the ranks (`_share`) and the metrics are
reduced over all ranks, so a step equals the single-process step up to float summation order.
"""
from __future__ import annotations

import math
import time

import torch

from app.training import correction, distributed
from app.training.batching import MicroBatch, StepSequence, make_micro_batches, padding_fraction, zero_advantage_indices
from app.training.grpo import policy_loss
from app.training.opd import apply_token_advantages, topk_forward_kl


def run_update(trainer, sequences: list[StepSequence]) -> dict:
    """Run one GRPO step of `trainer` (an `app.training.trainer.Trainer`: its model, optimizer
    and settings) over `sequences`; return its metrics (JSON-able floats and ints).

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
    activation_checkpointing, world_size, routing_replay (`Trainer.route_mismatch`: the share of
    recorded routes the live router would not have chosen; None when replay is off).
    Raises `app.training.trainer.SequenceTooLongError` before any forward pass (`Trainer.check_lengths`),
    and ValueError for a teacher top-k token outside the student's vocabulary.
    """
    start = time.perf_counter()
    cfg = trainer.config
    trainer.check_lengths(sequences)
    trainer.check_routes(sequences)  # routing replay: every trained chain's routes replayable, else named
    trainer.route_mismatch()  # start this step's tally
    # Chains with advantage 0 everywhere add exactly 0 to the loss and its gradient: with one update
    # per step and no KL term they are left out before any forward pass (`skip_zero_advantage`).
    # A mask must see every chain: it may drop their tokens from the denominator.
    masking = correction.needs_masks_first(cfg)
    skip = (zero_advantage_indices(sequences) if cfg.skip_zero_advantage and cfg.kl_coef == 0
            and not cfg.gradient_accumulation_steps and not masking else set())
    batches = make_micro_batches(sequences, cfg.micro_batch_tokens, cfg.loss_aggregation, trainer.pad_id, trainer.packing,
                                 leave_out=skip)
    batches = apply_token_advantages(batches, sequences)  # on-policy distillation: A_t per token
    if correction.sequence_level(cfg):
        correction.check_whole_chains(batches, sequences)
    for mb in batches:
        if mb.teacher_top_ids is not None and int(mb.teacher_top_ids.max()) >= trainer.shape.vocab:
            raise ValueError(f"the teacher's top-k holds token id {int(mb.teacher_top_ids.max())}, outside the "
                             f"student's vocabulary of {trainer.shape.vocab} (a teacher with a larger LM head)")
    metrics = {
        "sequences": sum(1 for s in sequences if s.trainable > 0),
        "micro_batches": len(batches),
        "tokens_trained": int(sum(mb.targets.numel() for mb in batches)),
        "tokens_processed": int(sum(mb.tokens for mb in batches)),
        "padded_tokens": int(sum(mb.padded_tokens for mb in batches)),
        "padding_fraction": padding_fraction(batches),
        "longest_micro_batch_tokens": max((mb.padded_tokens for mb in batches), default=0),
        **trainer.plan_checkpointing(batches),
        "packing": trainer.packing,
        "world_size": trainer.world,
        "sequences_zero_advantage_skipped": sum(1 for i in skip if sequences[i].trainable > 0),
    }
    if not batches:
        return {**metrics, "optimizer_updates": 0, "loss": 0.0, "update_time_s": time.perf_counter() - start}
    per_update = cfg.gradient_accumulation_steps or len(batches)
    chunks = [batches[i : i + per_update] for i in range(0, len(batches), per_update)]
    shares = [_share(trainer, chunk) for chunk in chunks]
    # With several updates per step, later updates see moved weights: their PPO ratio
    # needs logprobs from before the first update, so compute them all first.  A mask
    # needs them too: masked tokens leave the step's denominator (app.training.correction).
    old = ([[trainer.forward_logprobs(mb, grad=False).float() for mb, _real in share] for share in shares]
           if len(chunks) > 1 or masking else None)
    gaps = ([_gap(o, mb) for olds, share in zip(old, shares)
             for o, (mb, real) in zip(olds, share) if real] if old else [])
    stats_off = correction.CorrectionStats()
    # per update and micro-batch of this rank's share its TokenCorrection; with masks, per
    # update its sum of weights over the kept tokens of all ranks
    fixes, update_weights = (correction.correct_all(old, shares, sequences, cfg, stats_off, trainer.group)
                             if old is not None else (None, None))
    totals = {"loss": 0.0, "clipped": 0.0, "kl": 0.0, "tis": 0.0, "tis_truncated": 0.0, "ratio": 0.0,
              "topk_kl": 0.0, "topk_tokens": 0.0}
    grad_norm = 0.0
    skipped = nonfinite = 0
    for u, (chunk, share) in enumerate(zip(chunks, shares)):
        trainer.optimizer.zero_grad(set_to_none=True)
        # Each update is the aggregated mean over its own micro-batches.
        # (with chains left out, the whole step's weights, which sum to 1, are still the denominator)
        if update_weights is not None:  # over the kept tokens (0: all of this update is masked)
            scale = 1.0 / update_weights[u] if update_weights[u] > 0 else 0.0
        else:
            scale = 1.0 if skip else 1.0 / float(sum(mb.weights.sum() for mb in chunk))
        for j, ((mb, real), backward) in enumerate(zip(share, _needs_backward(trainer, share))):
            if not backward:
                # Zero advantage and no KL: this micro-batch's loss and gradient are exactly
                # zero, so skip the backward pass; the forward pass still measures the gap.
                if old is None:
                    values = trainer.forward_logprobs(mb, grad=False).float()
                    if real:
                        gaps.append(_gap(values, mb))
                        stats_off.add(correction.token_correction(values, mb.rollout_logprobs, mb.sequence_index,
                                                                  cfg), mb)
                skipped += int(real)
                continue
            top_logprobs = None
            if mb.teacher_top_ids is not None:  # distillation to the teacher's top-k (app.training.opd)
                logprobs, top_logprobs, top_log_rest = trainer.forward_logprobs(mb, grad=True, top=True)
                logprobs = logprobs.float()
            else:
                logprobs = trainer.forward_logprobs(mb, grad=True).float()
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
                ref_logprobs=trainer.reference_logprobs(mb),
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
            (loss * trainer.world).backward()
            if not (real and (cfg.kl_coef > 0 or bool(mb.advantages.any()) or top_logprobs is not None)):
                continue  # a filler, or one only run for the other ranks: stats as if skipped
            totals["loss"] += loss.item() / len(chunks)
            totals["clipped"] += stats.clipped
            totals["kl"] += stats.kl
            totals["tis"] += stats.tis_weight
            totals["tis_truncated"] += stats.tis_truncated
            totals["ratio"] += stats.ratio
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        norm = distributed.grad_norm_value(torch.nn.utils.clip_grad_norm_(trainer.params, max_norm))
        if not math.isfinite(norm):
            # A NaN or infinite loss or gradient: skip this update (weights and AdamW state
            # stay as they were, the step counter too) rather than poison the moments.
            nonfinite += 1
            continue
        grad_norm = max(grad_norm, norm)
        trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    gap = torch.cat([g for g, _ in gaps]) if gaps else torch.zeros(0)
    stale = torch.cat([m for _, m in gaps]) if gaps else torch.zeros(0, dtype=torch.bool)
    fresh_gap, stale_gap = gap[~stale.to(gap.device)], gap[stale.to(gap.device)]
    gap_max = float(fresh_gap.max()) if fresh_gap.numel() else 0.0
    stale_max = float(stale_gap.max()) if stale_gap.numel() else 0.0
    gap_sum, gap_count = float(fresh_gap.sum()), fresh_gap.numel()
    stale_sum, stale_count = float(stale_gap.sum()), stale_gap.numel()
    if trainer.group is not None:
        keys = list(totals)
        summed = trainer.group.all_reduce(torch.tensor([totals[k] for k in keys]
                                                    + [gap_sum, gap_count, stale_sum, stale_count, skipped]))
        totals = dict(zip(keys, summed[: len(keys)].tolist()))
        gap_sum, gap_count, stale_sum, stale_count, skipped = summed[len(keys):].tolist()
        gap_count, stale_count, skipped = int(gap_count), int(stale_count), int(skipped)
        gap_max, stale_max = trainer.group.all_reduce(torch.tensor([gap_max, stale_max]), op="max").tolist()
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
        "off_policy": stats_off.metrics(trainer.group),
        "grad_norm": grad_norm,
        "optimizer_updates": len(chunks),
        "micro_batches_zero_advantage": skipped,
        "nonfinite_updates_skipped": nonfinite,
        "update_time_s": time.perf_counter() - start,
        # routing replay: recorded (token, layer) pairs the live router would have routed elsewhere
        "routing_replay": trainer.route_mismatch(),
    })


def _share(trainer, chunk: list[MicroBatch]) -> list[tuple[MicroBatch, bool]]:
    """This rank's micro-batches of one update, on its device, as `(micro-batch, real)`.

    Rank r takes micro-batches r, r + world, ...; ranks with one fewer get a copy of the
    update's first micro-batch with `real` False (its loss weights are zeroed), so every
    rank runs the same number of forward/backward passes, as FSDP's collectives require.
    Alone: every micro-batch, all real.
    """
    rank = trainer.group.rank if trainer.group is not None else 0
    mine = [(mb.to(trainer.device), True) for mb in chunk[rank :: trainer.world]]
    missing = math.ceil(len(chunk) / trainer.world) - len(mine)
    return mine + [(chunk[0].to(trainer.device), False)] * missing


def _needs_backward(trainer, share: list[tuple[MicroBatch, bool]]) -> list[bool]:
    """Whether each position of this rank's share needs a backward pass: a real micro-batch
    with a nonzero advantage or a KL term.  Under FSDP, position j runs a backward on
    every rank as soon as one rank needs it (the same collectives on every rank)."""
    needed = [real and (trainer.config.kl_coef > 0 or bool(mb.advantages.any()) or mb.teacher_top_ids is not None)
              for mb, real in share]
    if trainer.group is not None:
        needed = [v > 0 for v in trainer.group.all_reduce(torch.tensor(needed, dtype=torch.float64), op="max").tolist()]
    return needed


def _finite_or_none(metrics: dict) -> dict:
    """`metrics` with NaN / infinite floats as None (JSON and PostgreSQL's JSONB refuse them)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}


def _gap(logprobs: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """|trainer - rollout| logprob (float [N], nats) of micro-batch `mb`'s sampled tokens, and
    which of them were sampled by older weights (bool [N], `mb.token_lag` > 0)."""
    return (logprobs - mb.rollout_logprobs).abs(), mb.token_lag.to(logprobs.device) > 0
