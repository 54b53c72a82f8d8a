"""Off-policy correction: the importance weights and masks of sampled tokens, and their metrics.

A trainable token t was sampled by an engine (its logprob rollout_t, recorded by the gateway,
perhaps under weights some versions older than the trainer's: `MicroBatch.token_lag`) and is
trained against the trainer's logprob before the update, old_t.  Every correction reads

    r_t = exp(old_t - rollout_t)            pi_old / pi_rollout of the sampled token

over the trainable tokens T_s of one chain s (one `StepSequence`; a chain is never split across
micro-batches, `app.training.batching`, so every sum below is over one micro-batch).  The run
chooses at most one weight and any masks (`TrainingConfig.off_policy_correction`):

    weights, on the policy-gradient term of each kept token
      token_tis  w_t = min(r_t, tis_cap)                      (tis_cap None: w_t = 1)
      seq_tis    w_t = min(prod_{u in T_s} r_u, seq_is_cap)   the same on every token of s
    masks: a masked token leaves the loss (its policy-gradient and KL terms)
      seq_mis    chain s masked when prod_{u in T_s} r_u is outside seq_mis_bounds
      geo_mask   chain s masked when exp(mean_{u in T_s} log r_u) is outside geo_mask_bounds
      icepop     token t masked when r_t is outside icepop_bounds

Sources:
* token_tis: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training" (fengyao.notion.site/off-policy-rl).
* seq_tis, seq_mis: Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse
  from the Training-Inference Mismatch" (richardli.xyz/rl-collapse, part 2: sequence-level
  TIS and MIS) and verl's rollout correction (verl.readthedocs.io/en/latest/algo/rollout_corr.html:
  `rollout_is: sequence`, `rollout_rs: sequence`).  Their MIS estimator, rho * 1{rho <= C}, is
  ["seq_tis", "seq_mis"] here with seq_is_cap >= the upper bound.
* geo_mask: SkyRL's geometric sequence mask (docs.skyrl.ai/docs/algorithms/off_policy_correction,
  `sequence_mask_metric: geometric`; verl's `rollout_rs: geometric`): the geometric mean does not
  grow with the chain's length as the product does, which suits long agentic chains.
* icepop: Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
  Thinking Model" (Ring-1T), arXiv:2510.18855, IcePop: M(k) = k inside [alpha, beta], else 0,
  which is ["icepop", "token_tis"] here with tis_cap >= beta.
Weights and masks are separate as in verl and slime PR #657 ("Decouple IS Weights from Rejection
Sampling in MIS"): the weight scales a token, a mask removes it.

The denominator (slime PR #657's trap): a masked token leaves the loss's denominator as well as
its numerator, else 3 masked tokens of 5 would shrink the step to 2/5 of its size.  The step's
aggregation weights are recomputed over the kept tokens (`mask_weights`): 1/N_kept per token
("token"), 1/(K_e * S_kept) ("sequence", K_e kept tokens of episode e, S_kept episodes with one).
So masks must be known before the first backward, but with one update per step old_t is the
grad forward's own detached value.  The trainer then runs a no-grad forward of every
micro-batch first (as it does for several updates per step): one more forward per micro-batch.
Measured (bench/off_policy_prepass.py, CPU, one thread, 8 chains of 1024 + 128 tokens, median of
5): the tiny model's step 1.15 s with token_tis, 1.14 s with seq_tis, 1.66 s with geo_mask (+44%);
with activation checkpointing the backward already re-runs the forward, so the share is smaller.
Weights need no such pass: they act inside one micro-batch.

Log-ratios are bounded above by 20 before exp (verl's safety bound), so a long drifting chain
gives a ratio of e^20, not inf; below, exp underflows to 0 harmlessly, and token_tis stays bit
for bit the weight it was before this module.  A chain's geometric mean uses the unbounded mean.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from app.runconfig import TrainingConfig

if TYPE_CHECKING:
    from app.training.batching import MicroBatch, StepSequence
    from app.training.distributed import RankGroup

LOG_RATIO_BOUND = 20.0
QUANTILES = (("p01", 0.01), ("p50", 0.5), ("p99", 0.99))
SEQUENCE_MODES = ("seq_tis", "seq_mis", "geo_mask")


@dataclass
class TokenCorrection:
    """The correction of a micro-batch's N trainable tokens: `log_ratio` float32 [N] (old - rollout,
    nats, unbounded), `weight` float32 [N] (w_t), `keep` bool [N] (False: masked), `truncated` bool
    [N] (the weight was capped)."""

    log_ratio: torch.Tensor
    weight: torch.Tensor
    keep: torch.Tensor
    truncated: torch.Tensor


def needs_masks_first(config: TrainingConfig) -> bool:
    """Whether `config` masks tokens, so the trainer must know every micro-batch's masks (a no-grad
    forward of each) before it weights the step."""
    return bool(config.correction_masks)


def sequence_level(config: TrainingConfig) -> bool:
    """Whether a correction of `config` reads a whole chain (its sum of log-ratios)."""
    return any(mode in SEQUENCE_MODES for mode in config.off_policy_correction)


def _inside(values: torch.Tensor, bounds: Sequence[float]) -> torch.Tensor:
    return (values >= bounds[0]) & (values <= bounds[1])


def chain_log_ratios(log_ratio: torch.Tensor, sequence_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the sum and the mean of `log_ratio` (float [N]) over its chain's tokens in the
    micro-batch (`sequence_index` int64 [N]): two float [N] tensors."""
    ids, inverse, counts = torch.unique(sequence_index, return_inverse=True, return_counts=True)
    sums = torch.zeros(ids.numel(), dtype=log_ratio.dtype, device=log_ratio.device).index_add_(0, inverse, log_ratio)
    return sums[inverse], (sums / counts.to(sums.dtype))[inverse]


def token_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, sequence_index: torch.Tensor,
                     config: TrainingConfig) -> TokenCorrection:
    """The weights and masks (see the module docstring) of one micro-batch's trainable tokens from
    the trainer's pre-update logprobs `old_logprobs` and the engine's `rollout_logprobs` (float
    [N], nats, no grad) and `sequence_index` (int64 [N]).  Every token of each chain must be in it
    (`check_whole_chains`).  With rollout == old every mode gives weight 1 and keeps every token."""
    log_ratio = (old_logprobs.detach() - rollout_logprobs.detach()).float()
    chosen = config.off_policy_correction
    ratio = torch.exp(log_ratio.clamp(max=LOG_RATIO_BOUND))
    if sequence_level(config):
        chain_sum, chain_mean = chain_log_ratios(log_ratio, sequence_index)
        chain_ratio = torch.exp(chain_sum.clamp(max=LOG_RATIO_BOUND))
    weight = torch.ones_like(ratio)
    truncated = torch.zeros_like(ratio, dtype=torch.bool)
    if "token_tis" in chosen and config.tis_cap is not None:
        truncated = ratio > config.tis_cap
        weight = ratio.clamp(max=config.tis_cap)
    elif "seq_tis" in chosen:
        truncated = chain_ratio > config.seq_is_cap
        weight = chain_ratio.clamp(max=config.seq_is_cap)
    keep = torch.ones_like(truncated)
    if "seq_mis" in chosen:
        keep &= _inside(chain_ratio, config.seq_mis_bounds)
    if "geo_mask" in chosen:
        keep &= _inside(torch.exp(chain_mean), config.geo_mask_bounds)
    if "icepop" in chosen:
        keep &= _inside(ratio, config.icepop_bounds)
    return TokenCorrection(log_ratio, weight, keep, truncated)


def check_whole_chains(batches: Sequence["MicroBatch"], sequences: Sequence["StepSequence"]) -> None:
    """Raise RuntimeError when a chain's trainable tokens are spread over several micro-batches
    (a chain-level weight or mask would then see part of it)."""
    seen: dict[int, int] = {}
    for mb in batches:
        ids, counts = torch.unique(mb.sequence_index, return_counts=True)
        for i, n in zip(ids.tolist(), counts.tolist()):
            if i in seen or n != sequences[i].trainable:
                raise RuntimeError(f"sequence {i} is split across micro-batches; chain-level off-policy correction "
                                   f"needs all of its {sequences[i].trainable} trainable tokens in one")
            seen[i] = n


def mask_weights(updates: list[list[tuple["MicroBatch", bool, torch.Tensor]]], sequences: Sequence["StepSequence"],
                 aggregation: str, group: "RankGroup | None" = None) -> list[float]:
    """Set the aggregation weights of masked micro-batches over their kept tokens only.

    `updates`: per optimizer update, this rank's `(micro-batch, real, keep)` (keep bool [N]; a
    micro-batch that is not `real` is another rank's filler and counts nowhere).  Each micro-batch's
    `weights` becomes, for a kept token of a sequence of episode e, 1/N_kept ("token": N_kept kept
    tokens of the step) or 1/(K_e * S_kept) ("sequence": K_e kept tokens of episode e over all of
    its chains, S_kept episodes with any); 0 for a masked token.  With every token kept this is
    `app.training.batching.aggregation_weights` exactly.  Counts are summed over `group`'s ranks.
    Returns each update's sum of weights over all ranks (0.0 when all of it is masked), the
    denominator of that update's mean.  Raises ValueError for an unknown `aggregation`.
    """
    kept = torch.zeros(len(sequences), dtype=torch.float64)
    for update in updates:
        for mb, real, keep in update:
            if real:
                kept.index_add_(0, mb.sequence_index.cpu(), keep.cpu().to(torch.float64))
    if group is not None:
        kept = group.all_reduce(kept)
    if aggregation == "token":
        denominator = torch.full_like(kept, float(kept.sum()))
    elif aggregation == "sequence":
        episode_of = [("episode", s.episode_id) if s.episode_id is not None else ("sequence", i)
                      for i, s in enumerate(sequences)]
        episodes = {key: n for n, key in enumerate(dict.fromkeys(episode_of))}
        index = torch.tensor([episodes[key] for key in episode_of], dtype=torch.long)
        episode_kept = torch.zeros(len(episodes), dtype=torch.float64).index_add_(0, index, kept)
        denominator = episode_kept[index] * float((episode_kept > 0).sum())
    else:
        raise ValueError(f"unknown loss aggregation {aggregation!r}")
    totals = torch.zeros(len(updates), dtype=torch.float64)
    for u, update in enumerate(updates):
        for mb, real, keep in update:
            d = denominator[mb.sequence_index.cpu()]
            weights = torch.where(keep.cpu() & (d > 0), 1.0 / d.clamp(min=1.0), torch.zeros_like(d))
            mb.weights = weights.to(dtype=torch.float32, device=mb.weights.device)
            if real:
                totals[u] += float(weights.sum())
    if group is not None:
        totals = group.all_reduce(totals)
    return totals.tolist()


def correct_all(old: list[list[torch.Tensor]], shares: list[list[tuple["MicroBatch", bool]]],
                sequences: Sequence["StepSequence"], config: TrainingConfig, stats: "CorrectionStats",
                group: "RankGroup | None" = None) -> tuple[list[list[TokenCorrection]], list[float] | None]:
    """The corrections of a step whose old logprobs are known first (`old`: per update, per
    micro-batch of this rank's `shares` of `(micro-batch, real)`, float [N]); each real one is added
    to `stats`.  With a mask, the micro-batches' weights are set over the kept tokens
    (`mask_weights`, whose per-update sums are returned; else None)."""
    fixes = [[token_correction(o, mb.rollout_logprobs, mb.sequence_index, config) for o, (mb, _real) in zip(olds, share)]
             for olds, share in zip(old, shares)]
    for fix_u, share in zip(fixes, shares):
        for fix, (mb, real) in zip(fix_u, share):
            if real:
                stats.add(fix, mb)
    if not needs_masks_first(config):
        return fixes, None
    updates = [[(mb, real, fix.keep) for fix, (mb, real) in zip(fix_u, share)] for fix_u, share in zip(fixes, shares)]
    return fixes, mask_weights(updates, sequences, config.loss_aggregation, group)


@dataclass
class CorrectionStats:
    """The step's off-policy metrics, gathered per micro-batch (`add`) and summarised (`metrics`)."""

    parts: list[tuple[torch.Tensor, ...]] = field(default_factory=list)

    def add(self, correction: TokenCorrection, mb: "MicroBatch") -> None:
        """Record a real micro-batch's correction with its tokens' lags and sequences."""
        self.parts.append((correction.log_ratio.detach().cpu(), correction.keep.cpu(), correction.weight.detach().cpu(),
                           mb.token_lag.cpu(), mb.sequence_index.cpu()))

    def metrics(self, group: "RankGroup | None" = None) -> dict:
        """The step's metrics over every rank's tokens (JSON-able; None where nothing was measured).

        `tokens_masked_fraction`, `sequences_masked_fraction` (chains with no kept token);
        `ratio_min|p01|p50|p99|max` of r_t = exp(old - rollout) over the trained tokens (bounded above
        by e^20; nearest-rank quantiles); `weight_ess_fraction` (sum w)^2 / (n sum w^2) over the kept
        tokens' weights, in (0, 1], 1 when every weight is equal (Kong 1992's effective sample size
        over n); `logprob_gap_lag{0,1,2plus}_mean_abs` |old - rollout| (nats) of the tokens sampled
        by weights 0, 1 or 2+ versions behind the trainer's, with their counts `tokens_lag{...}`.
        """
        parts = self.parts
        if group is not None:
            parts = [p for rank in group.gather_objects(parts) for p in rank]
        if not parts:
            return {}
        log_ratio, keep, weight, lag, seq = (torch.cat([p[k] for p in parts]) for k in range(5))
        n = log_ratio.numel()
        out: dict = {"tokens": n, "tokens_masked_fraction": float((~keep).sum()) / n if n else None}
        ids, inverse = torch.unique(seq, return_inverse=True)
        kept_per_seq = torch.zeros(ids.numel(), dtype=torch.long).index_add_(0, inverse, keep.long())
        out["sequences_masked_fraction"] = float((kept_per_seq == 0).sum()) / ids.numel() if ids.numel() else None
        ratio = torch.exp(log_ratio.double().clamp(max=LOG_RATIO_BOUND)).sort().values
        out["ratio_min"] = float(ratio[0]) if n else None
        for name, q in QUANTILES:
            out[f"ratio_{name}"] = float(ratio[min(n - 1, max(0, round(q * (n - 1))))]) if n else None
        out["ratio_max"] = float(ratio[-1]) if n else None
        w = weight[keep].double()
        square = float((w * w).sum())
        out["weight_ess_fraction"] = float(w.sum()) ** 2 / (w.numel() * square) if square > 0 else None
        gap = log_ratio.double().abs()
        for name, where in (("lag0", lag == 0), ("lag1", lag == 1), ("lag2plus", lag >= 2)):
            count = int(where.sum())
            out[f"tokens_{name}"] = count
            out[f"logprob_gap_{name}_mean_abs"] = float(gap[where].mean()) if count else None
        out.update(chain_spread(log_ratio, lag, seq))
        # NaN and inf as None: JSON and PostgreSQL's JSONB refuse them (an engine's -inf logprob)
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in out.items()}


def _quantile(sorted_values: torch.Tensor, q: float) -> float | None:
    n = sorted_values.numel()
    return float(sorted_values[min(n - 1, max(0, round(q * (n - 1))))]) if n else None


def chain_spread(log_ratio: torch.Tensor, lag: torch.Tensor, seq: torch.Tensor) -> dict:
    """The spread of the quantities the chain and token masks bound, split into on-policy chains
    (every trained token sampled by the trainer's weights, lag 0) and lagged ones (any token 1+
    versions behind), so that a mask's bounds can be set from what the run measured: wide enough
    that numerical noise (lag 0) never masks, and with the share a lagged chain would lose in view.

    From `log_ratio` float [N] (old - rollout, nats), `lag` int [N] and `seq` int64 [N] (chain
    index) over the step's trained tokens.  Keys, for `part` in {lag0, lagged}: `chains_{part}`;
    `geo_ratio_{part}_{min,max}`, the extremes of a chain's exp(mean_t log r_t) (geo_mask's
    quantity); `log_ratio_sum_{part}_{min,max}`, of sum_t log r_t (log of seq_mis' prod_t r_t);
    `token_ratio_{part}_{p001,p999}`, of r_t over that part's tokens (icepop's quantity).  None
    where the part has no chain.
    """
    out: dict = {}
    ids, inverse, counts = torch.unique(seq, return_inverse=True, return_counts=True)
    lr = log_ratio.double()
    sums = torch.zeros(ids.numel(), dtype=torch.float64).index_add_(0, inverse, lr)
    lag_max = torch.zeros(ids.numel(), dtype=torch.long).scatter_reduce_(0, inverse, lag.long(), reduce="amax")
    for part, chains in (("lag0", lag_max == 0), ("lagged", lag_max > 0)):
        n = int(chains.sum())
        out[f"chains_{part}"] = n
        geo = torch.exp(sums[chains] / counts[chains].double()).sort().values
        total = sums[chains].sort().values
        tokens = torch.exp(lr[chains[inverse]].clamp(max=LOG_RATIO_BOUND)).sort().values
        out[f"geo_ratio_{part}_min"], out[f"geo_ratio_{part}_max"] = (_quantile(geo, 0.0), _quantile(geo, 1.0))
        out[f"log_ratio_sum_{part}_min"], out[f"log_ratio_sum_{part}_max"] = (_quantile(total, 0.0),
                                                                              _quantile(total, 1.0))
        out[f"token_ratio_{part}_p001"], out[f"token_ratio_{part}_p999"] = (_quantile(tokens, 0.001),
                                                                            _quantile(tokens, 0.999))
    return out
