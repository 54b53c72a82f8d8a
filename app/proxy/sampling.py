"""The sampling transform a completion was drawn under, as recorded with it for the trainer.

Engines sample from the request's transformed distribution (temperature, top-k, top-p) and
report each sampled token's logprob under it (`app.engines.transform`; vLLM with
``--logprobs-mode processed_logprobs``).  The trainer must score the same tokens under the same
transform, so each completion records, in its ``normalized_request`` as
``turnstile_sampling`` (beside ``turnstile_flags``; no column of its own)::

    {"temperature": float, "top_p": float, "top_k": int,
     "support": [int | None, ...], "rank": [int | None, ...]}   # one entry per sampled token

``support`` is the size |K| of the kept support of each token and ``rank`` the number of tokens
that scored strictly higher than it (inside the support: rank < |K|); both lists are absent
without top-k/top-p.  None marks a token whose engine did not report them: the trainer then
derives |K| from its own scores and the recorded top_k/top_p.  Nothing is recorded for the
identity transform (temperature 1, no truncation) and for greedy requests (temperature 0:
the engine reports untransformed logprobs), so those completions train exactly as before.

Where the support comes from:

* the embedded engine reports ``support`` and ``rank`` in each logprob entry;
* vLLM reports neither, but with processed logprobs its ``top_logprobs`` show the tokens
  outside the support as -9999.0 (its JSON stand-in for -inf): when an entry's alternatives
  hold such a value, the finite ones are the whole support; when all n alternatives are finite
  and n >= top_k > 0, the support is top_k (a tie with the k-th score, which keeps more, aside).
  Otherwise (no alternatives asked for, or top-p alone keeping more than n) it is not reported.

Absent request fields mean the engines' defaults, temperature 1, top_p 1, top_k off (vLLM is
served with ``--generation-config vllm`` so that a model's own defaults do not apply unseen).
"""
from __future__ import annotations

from typing import Any

from app.engines.transform import GREEDY_EPS, truncates

NEG_INF_SHOWN = -9999.0  # vLLM's and the embedded engine's JSON value for a -inf logprob


def _number(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def transform_of(request: dict) -> tuple[float, float, int]:
    """(temperature, top_p, top_k) of an engine request, defaults filled (top_k -1 → 0)."""
    temperature = _number(request.get("temperature"), 1.0)
    top_p = _number(request.get("top_p"), 1.0)
    top_k = int(_number(request.get("top_k"), 0))
    return temperature, top_p, max(top_k, 0)


def _support_of(entry: dict, top_k: int) -> tuple[int | None, int | None]:
    """(support, rank) of one logprob entry (module docstring), Nones when not reported."""
    if isinstance(entry.get("support"), int) and isinstance(entry.get("rank"), int):
        return entry["support"], entry["rank"]
    top = [t.get("logprob") for t in entry.get("top_logprobs") or [] if isinstance(t, dict)]
    top = [float(v) for v in top if isinstance(v, (int, float))]
    own = entry.get("logprob")
    if not top or not isinstance(own, (int, float)):
        return None, None
    finite = [v for v in top if v > NEG_INF_SHOWN]
    if len(finite) < len(top):
        size = len(finite)
    elif 0 < top_k <= len(top):
        size = top_k
    else:
        return None, None
    return size, sum(1 for v in finite if v > float(own))


def sampling_record(request: dict, logprob_entries: list[dict], sampled: int) -> dict | None:
    """The ``turnstile_sampling`` record of one completion, or None for the identity or greedy.

    `request`: the engine request as sent; `logprob_entries`: the engine's logprob entries of
    the sampled tokens (``choices[0].logprobs.content`` across chunks); `sampled`: how many
    tokens were sampled (entries beyond the logprobs reported count as not reported).
    """
    temperature, top_p, top_k = transform_of(request)
    if temperature < GREEDY_EPS or (temperature == 1.0 and not truncates(top_k, top_p)):
        return None
    record: dict[str, Any] = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    if truncates(top_k, top_p):
        pairs = [_support_of(e, top_k) if isinstance(e, dict) else (None, None) for e in logprob_entries[:sampled]]
        pairs += [(None, None)] * (sampled - len(pairs))
        record["support"] = [s for s, _ in pairs]
        record["rank"] = [r for _, r in pairs]
    return record
