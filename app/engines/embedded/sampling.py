"""Per-request sampling and logprob recording for the embedded engine.

Logprob convention (what the trainer relies on): the recorded ``logprob`` of a sampled
token is ``log_softmax(logits)[token]`` of the **unmodified** model distribution, in
fp32 — temperature 1, no top-p/top-k truncation — even when the token was drawn from a
temperature-scaled or truncated distribution.  That is the quantity a GRPO trainer
recomputes with a plain forward pass (``π_θ(a|s)``), and it is what vLLM returns by
default (``logprobs_mode="raw_logprobs"``,
https://docs.vllm.ai/en/latest/api/vllm/config/model/#vllm.config.model.ModelConfig.logprobs_mode).
``top_logprobs`` come from the same unmodified distribution.

Sampling order (as in vLLM/HF): temperature scaling → top-k → top-p (nucleus, Holtzman
et al. 2019, https://arxiv.org/abs/1904.09751) → multinomial draw with the request's own
``torch.Generator`` (seeded when the request gives ``seed``, so a seeded request alone
in the engine is reproducible bit for bit).  ``temperature == 0`` means greedy argmax.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Validated sampling settings of one request.

    Attributes:
        temperature: ≥ 0; 0 → greedy.
        top_p: in (0, 1].
        top_k: ≤ 0 disables; else keep the k most likely tokens.
        seed: optional int seed for the request's generator.
        top_logprobs: 0–20 alternatives recorded per sampled token.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    top_logprobs: int = 0
    generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))


def sample_next(logits: torch.Tensor, params: SamplingParams) -> int:
    """Draw one token id from one row of fp32 logits (shape ``[vocab]``)."""
    if params.temperature < GREEDY_EPS:
        return int(torch.argmax(logits))
    scores = logits / params.temperature
    if params.top_k and 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        # Drop a token when the mass *before* it already reaches top_p (keeps ≥ 1 token).
        drop_sorted = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=params.generator))


@dataclass(frozen=True)
class TokenSample:
    """One generated token: id, its fp32 logprob under the unmodified model, and top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), most likely first


def sample_batch(logits: torch.Tensor, params: list[SamplingParams]) -> list[TokenSample]:
    """Sample one token per row of ``logits`` (``[batch, vocab]``, any float dtype).

    Returns one ``TokenSample`` per row, logprobs computed in fp32 (see module docstring).
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    out = []
    for row, p in enumerate(params):
        token = sample_next(logits[row], p)
        top: tuple[tuple[int, float], ...] = ()
        if p.top_logprobs:
            values, ids = torch.topk(logprobs[row], p.top_logprobs)
            top = tuple(zip(ids.tolist(), values.tolist()))
        out.append(TokenSample(token, float(logprobs[row, token]), top))
    return out
