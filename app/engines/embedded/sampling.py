"""Per-request sampling and logprob recording for the embedded engine.

Logprob convention (what the trainer relies on): the recorded ``logprob`` of a sampled token
is its log-probability under the distribution it was **drawn from**: the model's logits, upcast
to fp32 (an engine serving bfloat16 computes bf16 logits; the log-softmax and every transform
after it run in fp32 on them), divided by the request's temperature, truncated by its top-k and top-p, renormalised
(``app.engines.transform``, which the trainer scores with too).  This is vLLM's
``logprobs_mode="processed_logprobs"``
(https://docs.vllm.ai/en/latest/api/vllm/config/model/#vllm.config.model.ModelConfig.logprobs_mode),
which Turnstile serves vLLM with.  With top-k or top-p each token also records its kept
support as its size (``TokenSample.support``) and its own rank in it, and ``top_logprobs``
come from the same processed distribution (a token outside the support shows -9999.0, vLLM's
JSON stand-in for -inf).  Temperature 0 (greedy) and temperature 1 without truncation record
the unmodified ``log_softmax(logits)[token]``, as before.

Sampling order (as in vLLM/HF): temperature scaling → top-k → top-p (nucleus, Holtzman
et al. 2019, https://arxiv.org/abs/1904.09751) → multinomial draw with the request's own
``torch.Generator`` (seeded when the request gives ``seed``, so a seeded request alone
in the engine is reproducible bit for bit).  ``temperature == 0`` means greedy argmax.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from app.engines.transform import GREEDY_EPS, processed_logprobs, support_size, truncates


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


@dataclass(frozen=True)
class TokenSample:
    """One generated token: id, its fp32 logprob under the distribution it was drawn from, top
    alternatives, and with top-k/top-p its support size |K| and rank (tokens scoring strictly
    higher; < |K|); both None when nothing was truncated (module docstring)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), most likely first
    support: int | None = None
    rank: int | None = None


JSON_NEG_INF = -9999.0  # what a -inf logprob is shown as (vLLM's serving code clamps the same way)


def sample_row(logits: torch.Tensor, params: SamplingParams) -> TokenSample:
    """Draw one token from one row of fp32 logits (``[vocab]``) and record it (module docstring)."""
    vocab = logits.shape[-1]
    if params.temperature < GREEDY_EPS:
        token = int(torch.argmax(logits))
        return _recorded(torch.log_softmax(logits, dim=-1), token, params, None, None)
    scores = logits / params.temperature
    size = None
    if truncates(params.top_k, params.top_p, vocab):
        sorted_scores, order = torch.sort(scores, descending=True)
        size = support_size(sorted_scores, params.top_k, params.top_p)
        masked = torch.full_like(scores, float("-inf"))
        masked[order[:size]] = sorted_scores[:size]
        scores = masked
    token = int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=params.generator))
    rank = None if size is None else int((scores > scores[token]).sum())
    processed = torch.log_softmax(scores, dim=-1)
    if size is None:  # temperature only (T = 1: exactly the untransformed log softmax, as before)
        return _recorded(processed, token, params, None, None)
    # The recorded value is computed by the very function the trainer scores with.
    value = processed_logprobs(logits.unsqueeze(0), torch.tensor([token]), torch.tensor([params.temperature]),
                               torch.tensor([size]))
    return _recorded(processed, token, params, size, rank, float(value[0]))


def _recorded(logprobs: torch.Tensor, token: int, params: SamplingParams, support: int | None,
              rank: int | None, value: float | None = None) -> TokenSample:
    top: tuple[tuple[int, float], ...] = ()
    if params.top_logprobs:
        values, ids = torch.topk(logprobs, params.top_logprobs)
        top = tuple((i, max(v, JSON_NEG_INF)) for i, v in zip(ids.tolist(), values.tolist()))
    return TokenSample(token, float(logprobs[token]) if value is None else value, top, support, rank)


def sample_batch(logits: torch.Tensor, params: list[SamplingParams]) -> list[TokenSample]:
    """Sample one token per row of ``logits`` (``[batch, vocab]``, any float dtype).

    Returns one ``TokenSample`` per row, logprobs computed in fp32 (see module docstring).
    """
    logits = logits.float()
    return [sample_row(logits[row], p) for row, p in enumerate(params)]
