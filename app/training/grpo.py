"""GRPO: group advantages and the clipped, importance-corrected policy loss.

The objective implemented here, per trainable token t of a sequence from episode i:

    r_t    = exp(logp_t - old_t)                       PPO ratio against the trainer's
                                                       pre-update logprobs (detached)
    pg_t   = -min(r_t * A_i, clip(r_t, 1 - eps_low, 1 + eps_high) * A_i)
    w_t    = min(exp(old_t - rollout_t), C)            truncated importance weight (TIS)
    d_t    = ref_t - logp_t
    kl_t   = exp(d_t) - d_t - 1   ("k3", default)  or  d_t^2 / 2   ("k2")   (optional)
    loss_t = w_t * pg_t + beta * kl_t

w_t is token TIS by default; `app.training.correction` gives the other off-policy corrections
(a chain-level weight, and masks m_t that drop a token's loss_t: loss_t = m_t * (...)).

* Group advantage A_i = (R_i - mean_g R) / std_g R: DeepSeekMath, Shao et al. 2024,
  "Pushing the Limits of Mathematical Reasoning in Open Language Models", arXiv:2402.03300,
  §4.1.2 (outcome supervision).  Leave-one-out baseline: Ahmadian et al. 2024 (RLOO,
  arXiv:2402.14740).  Every sequence
  (chain) of episode i carries A_i.
* Separate clip ranges ("clip-higher") and token-level aggregation: DAPO, Yu et al. 2025,
  arXiv:2503.14476, eq. 8–10.
* TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training" (fengyao.notion.site/off-policy-rl): the engine that sampled (rollout logprobs,
  recorded by the gateway) and the trainer differ numerically and, with asynchronous
  rollouts, in weights; the token gradient is re-weighted by the truncated ratio
  trainer/rollout.
* KL penalty to the reference policy (`kl_estimator`).  Both estimators are from Schulman 2020,
  "Approximating KL divergence" (joschu.net/blog/kl-approx.html).  On tokens sampled from the
  policy, k3's *value* is an unbiased estimate of the reverse KL(policy || ref), which is why it
  is the reported `kl` metric.  But differentiated as a loss (samples held fixed, as here),
  E_policy[grad k3] = grad KL(ref || policy): k3 as a loss optimises the *forward* KL (Tang &
  Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL",
  arXiv:2506.09477, §3).  k3 stays the default because it is DeepSeekMath's (eq. 4) and what
  earlier runs used.  k2 = d^2 / 2 has E_policy[grad k2] = E_policy[(logp - ref) grad logp]
  = grad KL(policy || ref): the reverse KL's gradient (same paper, §3; exactly so on-policy,
  i.e. before the PPO ratio moves).  Both are per-token terms: neither carries the effect of
  a token on later tokens' distributions (the paper's §4 "partial gradient").

* The policy is the one that sampled: logp_t, old_t, ref_t and rollout_t are all logprobs under
  the sampling transform the token was drawn with (`app.engines.transform`):

      logp_t = z_t[a_t] / T_t - logsumexp_{v in K_t} z_t[v] / T_t

  z_t the logits, T_t the request's temperature, K_t the |K_t| highest-scoring tokens kept by
  its top-k and top-p (|K_t| recorded by the engine per token).  Scoring the untransformed
  log softmax(z_t) instead would make r_t and w_t ratios between two different policies and the
  gradient that of a policy nobody sampled from: with T = 0.7, top-p 0.9, top-k 20 the gap is
  ~5 nats per token on the tiny test model against 2e-6 under the transform
  (tests/engines/embedded/test_sampling_transform.py).  Temperature and truncation as in
  Holtzman et al. 2019, arXiv:1904.09751, §3.1; vLLM reports the same quantity with
  `logprobs_mode="processed_logprobs"`.  The KL reference is scored under the same transform.

All tensors are 1-D over the trainable tokens of a micro-batch, shape [N], float32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from app.advantages import group_advantages  # noqa: F401 (torch-free, shared with the dashboard)
from app.runconfig import ADVANTAGE_MODES, KL_ESTIMATORS, LOSS_AGGREGATIONS  # noqa: F401 (re-exported for callers)

if TYPE_CHECKING:
    from app.training.correction import TokenCorrection


@dataclass
class LossStats:
    """Sums over the micro-batch's trainable tokens (divide by the token count for means)."""

    tokens: int
    clipped: float
    kl: float
    tis_weight: float
    tis_truncated: float
    ratio: float


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    tis_cap: float | None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    correction: "TokenCorrection | None" = None,
) -> tuple[torch.Tensor, LossStats]:
    """The GRPO loss of one micro-batch (see the module docstring for the formula).

    Inputs, all [N] float32 over trainable tokens: `logprobs` (trainer, with grad),
    `old_logprobs` (trainer before this step's update, no grad), `rollout_logprobs`
    (recorded by the gateway), `advantages` (the episode's advantage on each of its tokens),
    `weights` (aggregation weight per token: 1/N_step for token-level, 1/(len_seq * S_step)
    for sequence-level, per episode; see `batching.aggregation_weights`), `ref_logprobs` (reference model, only
    with `kl_coef` > 0).  `kl_estimator` is "k3" (gradient of the forward KL) or "k2" (gradient of
the reverse KL); `LossStats.kl` sums k3's value either way.  `tis_cap` None disables importance
correction.  `correction` (`app.training.correction.token_correction`), when given, replaces
token TIS: its `weight` is w_t and a token it does not `keep` adds nothing (the caller's `weights`
exclude it from the denominator).  Raises ValueError for an unknown `kl_estimator`.  Returns the scalar
    loss `sum(weights * loss_t)`; summing it over the step's micro-batches gives the step's
    aggregated loss exactly, so gradient accumulation is plain `backward()` per micro-batch.
    """
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kl_estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")
    old = old_logprobs.detach()
    log_ratio = logprobs - old
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    pg = -torch.minimum(unclipped, clipped)
    if correction is not None:
        tis = correction.weight
        truncated = correction.truncated.float().sum().item()
    elif tis_cap is not None:
        raw = torch.exp(old - rollout_logprobs.detach())
        tis = torch.clamp(raw, max=tis_cap)
        truncated = (raw > tis_cap).float().sum().item()
    else:
        tis = torch.ones_like(pg)
        truncated = 0.0
    per_token = tis * pg
    kl_sum = 0.0
    if ref_logprobs is not None and kl_coef > 0.0:
        delta = ref_logprobs.detach() - logprobs
        k3 = torch.exp(delta) - delta - 1.0
        penalty = k3 if kl_estimator == "k3" else 0.5 * delta * delta
        per_token = per_token + kl_coef * penalty
        kl_sum = k3.detach().sum().item()
    if correction is not None:  # where(), not a product: a masked token's inf or NaN must not reach the sum
        per_token = torch.where(correction.keep, per_token, torch.zeros_like(per_token))
    loss = (per_token * weights).sum()
    with torch.no_grad():
        is_clipped = ((ratio < 1.0 - clip_low) & (advantages < 0)) | ((ratio > 1.0 + clip_high) & (advantages > 0))
        stats = LossStats(
            tokens=int(logprobs.numel()),
            clipped=is_clipped.float().sum().item(),
            kl=kl_sum,
            tis_weight=tis.sum().item(),
            tis_truncated=truncated,
            ratio=ratio.sum().item(),
        )
    return loss, stats
