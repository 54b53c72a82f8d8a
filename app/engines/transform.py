"""The sampling transform (temperature, top-k, top-p) and logprobs under it, shared by the
embedded engine, which samples with it, and the trainer, which scores the same tokens with it.

For logits z (fp32 [V]) and a request's temperature T > 0, top_k k (<= 0: off) and top_p p
in (0, 1], the policy that samples is

    s      = z / T                                     temperature
    K      = the |K| highest s, |K| = support_sizes(s, k, p)   (top-k, then top-p)
    q(v)   = exp(s_v - logsumexp_{u in K} s_u)  for v in K, 0 outside K
    logq_a = s_a - logsumexp_{u in K} s_u              the recorded logprob of sampled token a

in vLLM's order (temperature, then top-k, then top-p: vllm/v1/sample/ops/topk_topp_sampler.py,
``apply_top_k_top_p``), with top-p as in Holtzman et al. 2019, "The Curious Case of Neural Text
Degeneration", arXiv:1904.09751, §3.1: keep the smallest prefix of the tokens sorted by
probability whose mass reaches p, i.e. a token is kept while the mass strictly before it is
< p.  T = 0 is greedy: argmax, and the recorded logprob is the untransformed log softmax(z)
(as vLLM's processed logprobs of a greedy request, which skip the temperature).  T = 1,
k off, p = 1 is the identity: logq = log softmax(z).

The kept support is recorded as its size |K| (an int per sampled token; None when nothing
is truncated).  Why the size, not the set or a threshold:

* exact and compact: K is always the |K| largest scores (top-k keeps a prefix of the sorted
  scores, ties with the k-th included, and top-p keeps a prefix of that), so one integer
  names the set, where the set itself is up to k ids and a threshold is a float;
* robust to numerics: the trainer's logits differ from the engine's by float rounding
  (~1e-6 in fp32, more under bf16).  A recomputed top-p *set* can then gain or lose a
  boundary token (an 8e-5 logit difference was enough in a public report), and a threshold
  compared with recomputed logits moves the boundary the same way; the size keeps the
  normaliser over the same number of tokens whatever the rounding.  Should the sampled token
  itself fall outside the trainer's top |K| (a tie or a near-tie at the boundary), the trainer
  takes its top |K|-1 plus the sampled token (`processed_logprobs`): the engine's K holds it.

The sampled token's `rank` (how many tokens score strictly higher) is recorded beside it, so
that ingestion can refuse a capture whose token lies outside its own support (rank >= |K|)
without a model.

torch is imported by the functions that need it, so the gateway (torch-free) can use
`truncates` and `GREEDY_EPS`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GREEDY_EPS = 1e-5   # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
MASKED = -1e30      # score of a token outside the support in a logsumexp (exp underflows to 0)


def truncates(top_k: int | None, top_p: float | None, vocab: int | None = None) -> bool:
    """Whether top-k / top-p can drop tokens: top_k in [1, vocab) or top_p < 1."""
    k = int(top_k or 0)
    return (k > 0 and (vocab is None or k < vocab)) or (top_p is not None and float(top_p) < 1.0)


def support_size(sorted_scores: torch.Tensor, top_k: int, top_p: float) -> int:
    """|K| for one row of temperature-scaled scores sorted descending (fp32 [V]).

    Top-k keeps the k highest, ties with the k-th included; top-p then keeps the tokens whose
    preceding mass (under the top-k renormalised distribution) is < top_p, at least one.
    """
    import torch

    vocab = sorted_scores.shape[-1]
    size = vocab
    if 0 < top_k < vocab:
        size = int((sorted_scores >= sorted_scores[top_k - 1]).sum())
    if top_p < 1.0:
        probs = torch.softmax(sorted_scores[:size], dim=-1)
        before = probs.cumsum(dim=-1) - probs
        size = max(1, int((before < top_p).sum()))
    return size


def derived_support(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """|K| of each row of temperature-scaled `scores` (float [n, V]) for its `top_k` (int64 [n],
    <= 0 off) and `top_p` (float [n]): `support_size` row by row, vectorised, no gradient.
    Used where an engine did not report the support (it is re-derived from the scores here)."""
    import torch

    with torch.no_grad():
        vocab = scores.shape[-1]
        ordered = torch.sort(scores.float(), dim=-1, descending=True).values
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).to(torch.long).unsqueeze(-1)
        kth = ordered.gather(-1, k - 1)
        kept = ordered >= kth
        size = kept.sum(-1)
        probs = torch.softmax(ordered.masked_fill(~kept, float("-inf")), dim=-1)
        before = probs.cumsum(-1) - probs
        nucleus = ((before < top_p.float().unsqueeze(-1)) & kept).sum(-1).clamp(min=1)
        return torch.where(top_p < 1.0, nucleus, size)


def processed_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor | None,
                       support: torch.Tensor | None, top_k: torch.Tensor | None = None,
                       top_p: torch.Tensor | None = None) -> torch.Tensor:
    """logq of `targets` under the transform (module docstring), differentiable in `logits`.

    `logits`: float [N, V] (computed in fp32); `targets`: int64 [N]; `temperature`: float [N]
    (1.0 for rows without one, greedy rows included) or None (all 1); `support`: int64 [N], |K|
    per row, 0 for "the whole vocabulary", -1 for "not reported: derive it from this row's
    `top_k` / `top_p`" (int64 / float [N], needed then; `derived_support`), or None (all 0).
    The sampled token is always in
    the support used: when it is not among the row's |K| highest scores here, the support is
    the |K|-1 highest plus the sampled token (the engine's K holds it; only rounding moved it).
    Returns float32 [N].
    """
    import torch

    scores = logits.float()
    if temperature is not None:
        scores = scores / temperature.to(scores.device, torch.float32).unsqueeze(-1)
    target_scores = scores.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    full = torch.logsumexp(scores, dim=-1)
    if support is None:
        return target_scores - full
    support = support.to(scores.device, torch.long)
    derive = support < 0
    if bool(derive.any()):
        if top_k is None or top_p is None:
            raise ValueError("a support of -1 (not reported) needs top_k and top_p to derive it")
        rows = derive.nonzero(as_tuple=True)[0]
        support = support.clone()
        support[rows] = derived_support(scores[rows], top_k.to(scores.device)[rows], top_p.to(scores.device)[rows])
    cut = (support > 0) & (support < scores.shape[-1])
    if not bool(cut.any()):
        return target_scores - full
    width = int(support[cut].max())
    top = torch.topk(scores, width, dim=-1).values                        # [N, width], descending
    column = torch.arange(width, device=scores.device).unsqueeze(0)
    size = torch.where(cut, support, width).clamp(1, width).unsqueeze(-1)
    kth = top.gather(-1, size - 1).squeeze(-1)
    inside = target_scores >= kth                                        # sampled token in the top |K|
    keep = torch.where(inside.unsqueeze(-1), column < size, column < size - 1)
    # A finite fill, not -inf: a row that keeps none of `top` (|K| = 1, token outside) would
    # otherwise give logsumexp -inf and a NaN gradient even where torch.where discards it.
    lse = torch.logsumexp(top.masked_fill(~keep, MASKED), dim=-1)
    lse = torch.where(inside, lse, torch.logaddexp(lse, target_scores))
    return torch.where(cut, target_scores - lse, target_scores - full)


def kept_threshold(scores: torch.Tensor, targets: torch.Tensor, support: torch.Tensor, top_k: torch.Tensor | None = None,
                   top_p: torch.Tensor | None = None) -> torch.Tensor:
    """The support `processed_logprobs` normalises over, as a threshold: K = {v : scores_v >= thr}
    plus the target (float32 [n]; -inf for rows over the whole vocabulary).  `scores` are the
    temperature-scaled logits [n, V]; `support`, `top_k`, `top_p` as in `processed_logprobs`
    (-1 derived).  No gradient: the fused loss head keeps this per row instead of a [n, V] mask
    (`app.training.head`); a score tied with the threshold counts in, where `processed_logprobs`
    takes exactly |K| (ties between fp32 logits aside, the same set).
    """
    import torch

    with torch.no_grad():
        scores = scores.float()
        support = support.to(scores.device, torch.long).clone()
        derive = support < 0
        if bool(derive.any()):
            if top_k is None or top_p is None:
                raise ValueError("a support of -1 (not reported) needs top_k and top_p to derive it")
            rows = derive.nonzero(as_tuple=True)[0]
            support[rows] = derived_support(scores[rows], top_k.to(scores.device)[rows], top_p.to(scores.device)[rows])
        vocab = scores.shape[-1]
        cut = (support > 0) & (support < vocab)
        thr = torch.full((scores.shape[0],), float("-inf"), device=scores.device)
        if not bool(cut.any()):
            return thr
        width = int(support[cut].max())
        top = torch.topk(scores, width, dim=-1).values
        size = torch.where(cut, support, width).clamp(1, width).unsqueeze(-1)
        kth = top.gather(-1, size - 1).squeeze(-1)
        before = torch.cat([torch.full_like(top[:, :1], float("inf")), top], dim=-1).gather(-1, size - 1).squeeze(-1)
        inside = scores.gather(-1, targets.unsqueeze(-1)).squeeze(-1) >= kth
        return torch.where(cut, torch.where(inside, kth, before), thr)
