"""Trajectory builders: turn an episode's completions into token-exact training sequences.

Two builders, both pure functions over `CompletionRecord`s (no database, no torch):

* `per_request` — every completion is its own sequence: `prompt_ids` (loss mask 0) followed
  by `sampled_ids` (loss mask 1, recorded rollout logprobs).  Simple, works for any call
  pattern, but an N-call session re-processes its growing prefix N times.
* `prefix_merging` — a completion whose `prompt_ids` start with an open chain's full token
  stream (that chain's last prompt ids + last sampled ids) extends that chain: the tokens in
  between (tool results, template glue such as an end-of-turn the engine did not sample) get
  loss mask 0 and logprob 0.0, its sampled ids get mask 1 and their recorded logprobs.  When
  several chains qualify the longest stream wins (prime-rl PR #2634).  A completion that
  extends no open chain (context compaction, a sub-agent with its own system prompt, a
  harness that rewrote or re-tokenized the previous assistant turn, a retry) starts a new
  chain; the reason is counted.  Unlike schemes that merge by comparing rendered text, we
  compare prompt *and* sampled ids, so every merged sequence is exactly
  the token stream the engine saw and sampled: nothing is re-rendered
  and no canonical end-of-turn is substituted.

Sampled ids are never re-tokenized.  Captures that cannot be trained on are rejected by
`validate_completion` with a reason, left out of every sequence, and counted in the report.

Each completion's sampling transform (temperature, top-p, top-k and the kept support per
sampled token, `app.proxy.sampling`) travels with its span: `TrainingSequence.sampling`, then
per token in `SequenceTransform` (`sequence_transform`), so the trainer scores every sampled
token under the distribution it was drawn from.  A token recorded outside its own support
(rank >= |K|, or vLLM's -9999.0 for a -inf logprob under truncation) is refused here.

An MoE policy's routed experts travel too: `CompletionRecord.routes` -> `TrainingSequence.routes`
(int16 `[T, layers, top_k]`, for routing replay), merged by `app.training.chain_routes`' rule.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from app.runconfig import BUILDERS  # noqa: F401 (the builder names; validated in TrainingConfig)
from app.training.chain_routes import ChainRoutes, fitting, routes_report


@dataclass(frozen=True)
class CompletionRecord:
    """The fields of one captured completion that training needs.

    `prompt_ids` int32 [P] as rendered by the engine; `sampled_ids` int32 [S] as sampled;
    `logprobs` float32 nats [S], one per sampled id.  `completion_id` is `Completion.id`
    (None for records built by hand); `seq` is the arrival order within the episode.
    `routes`: an MoE engine's expert ids, int16 [P + S - 1, layers, top_k] (the prompt and every
    sampled token but the last, which never ran through the model), None without.
    """

    seq: int
    prompt_ids: Sequence[int] | None
    sampled_ids: Sequence[int] | None
    logprobs: Sequence[float] | None
    finish_reason: str | None = None
    completion_id: int | None = None
    policy_version: int | None = None
    sampling: Mapping | None = None  # `app.proxy.sampling` record; None: the identity transform
    # Per-token versions of the sampled ids, run-length encoded (`app.versions`); None: all `policy_version`.
    policy_versions: Sequence[Sequence[int]] | None = None
    routes: np.ndarray | None = field(default=None, compare=False)


@dataclass
class TrainingSequence:
    """One training sequence (a chain, or a single completion for `per_request`).

    `token_ids` int [T], `loss_mask` int 0/1 [T] (1 = sampled by the policy), `logprobs`
    float nats [T] (rollout logprob where the mask is 1, 0.0 elsewhere).  `completions` lists
    the `completion_id`s (or `seq`s when ids are absent) merged into it, in order;
    `spans` holds one `[start, end)` token range of sampled ids per merged completion, and
    `sampling` its sampling record (None: the identity transform), in the same order;
    `version_runs` each span's per-token policy versions (runs over the span's tokens,
    `app.versions`; None: the span's one `policy_versions` entry covers all its tokens).
    `routes` int16 [T, layers, top_k]: the expert ids each position ran through in the rollout,
    -1 at the last token (nothing ran it, no logit is scored from it); None when some merged
    completion has none (`app.training.chain_routes`).
    """

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    completions: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    policy_versions: list[int | None] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    sampling: list[Mapping | None] = field(default_factory=list)
    version_runs: list[list | None] = field(default_factory=list)
    routes: np.ndarray | None = field(default=None, compare=False)

    @property
    def trainable_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class BuildResult:
    """The sequences of one episode plus the per-episode report (a JSON-able dict)."""

    sequences: list[TrainingSequence]
    report: dict
    rejected: dict[int, str]  # record index -> reason text


# --- validation (ingestion checks) ------------------------------------------------------


def validate_completion(record: CompletionRecord, vocab_size: int | None = None) -> str | None:
    """Return why `record` cannot be trained on, or None when it can.

    The reason starts with a short kind (`missing_prompt_ids`, `missing_sampled_ids`,
    `empty_sampled_ids`, `missing_logprobs`, `logprobs_length_mismatch`,
    `token_id_out_of_vocab`, `invalid_sampling`, `sampled_outside_support`, `invalid_logprob`),
    then a colon and details, so reports can count kinds.  `vocab_size` is the number of rows of the model's embedding; ids must lie
    in `[0, vocab_size)`.
    """
    if not record.prompt_ids:
        return "missing_prompt_ids: the capture has no prompt token ids"
    if record.sampled_ids is None:
        return "missing_sampled_ids: the capture has no sampled token ids"
    if len(record.sampled_ids) == 0:
        return "empty_sampled_ids: the engine sampled no tokens"
    if record.logprobs is None:
        return "missing_logprobs: the capture has no rollout logprobs"
    if len(record.logprobs) != len(record.sampled_ids):
        return (
            f"logprobs_length_mismatch: len(logprobs)={len(record.logprobs)} "
            f"!= len(sampled_ids)={len(record.sampled_ids)}"
        )
    if vocab_size is not None:
        for where, ids in (("prompt_ids", record.prompt_ids), ("sampled_ids", record.sampled_ids)):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                return f"token_id_out_of_vocab: {where} holds id {bad}, vocab_size={vocab_size}"
    if record.sampling is not None:
        reason = _sampling_problem(record, vocab_size)
        if reason is not None:
            return reason
    for i, lp in enumerate(record.logprobs):
        # A logprob is log p with p in (0, 1]; allow float32 rounding just above 0.
        if not math.isfinite(lp) or lp > 1e-4:
            return f"invalid_logprob: logprobs[{i}]={lp!r} is not a finite value <= 0"
    return None


NEG_INF_SHOWN = -9999.0  # engines' JSON value for a -inf logprob (a token outside the support)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sampling_problem(record: CompletionRecord, vocab_size: int | None) -> str | None:
    """Why `record.sampling` cannot be trained on (`invalid_sampling`, `sampled_outside_support`), or None."""
    sampling, n = record.sampling, len(record.sampled_ids)
    temperature, top_p, top_k = sampling.get("temperature"), sampling.get("top_p"), sampling.get("top_k")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        return f"invalid_sampling: temperature={temperature!r} is not a finite number > 0"
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        return f"invalid_sampling: top_p={top_p!r} is not in (0, 1]"
    if not (_is_int(top_k) and top_k >= 0):
        return f"invalid_sampling: top_k={top_k!r} is not an integer >= 0"
    if top_k > 0 or top_p < 1:
        for i, lp in enumerate(record.logprobs):
            if isinstance(lp, (int, float)) and lp <= NEG_INF_SHOWN:
                return (f"sampled_outside_support: logprobs[{i}]={lp!r} is the engine's -inf: sampled_ids[{i}]="
                        f"{record.sampled_ids[i]} lies outside the top-k/top-p support it was drawn from")
    support, rank = sampling.get("support"), sampling.get("rank")
    if support is None and rank is None:
        return None
    if not (isinstance(support, list) and isinstance(rank, list) and len(support) == len(rank) == n):
        return f"invalid_sampling: support and rank must be lists of one entry per sampled id ({n})"
    for i, (size, place) in enumerate(zip(support, rank)):
        if size is None and place is None:
            continue
        if not (_is_int(size) and _is_int(place) and size >= 1 and place >= 0):
            return f"invalid_sampling: support[{i}]={size!r}, rank[{i}]={place!r} are not integers >= 1 and >= 0"
        if vocab_size is not None and size > vocab_size:
            return f"invalid_sampling: support[{i}]={size} exceeds vocab_size={vocab_size}"
        if place >= size:
            return (f"sampled_outside_support: sampled_ids[{i}]={record.sampled_ids[i]} ranks {place} "
                    f"(0 = most likely), outside its recorded support of {size} tokens")
    return None


def reason_kind(reason: str) -> str:
    """The short kind of a rejection reason (the text before the first colon)."""
    return reason.split(":", 1)[0]


def _accept(records: Iterable[CompletionRecord], vocab_size: int | None):
    ordered = sorted(enumerate(records), key=lambda pair: pair[1].seq)
    accepted: list[CompletionRecord] = []
    rejected: dict[int, str] = {}
    for index, record in ordered:
        reason = validate_completion(record, vocab_size)
        if reason is None:
            accepted.append(record)
        else:
            rejected[index] = reason
    return accepted, rejected, len(ordered)


def _base_report(builder: str, total: int, rejected: dict[int, str]) -> dict:
    return {
        "builder": builder,
        "completions": total,
        "accepted": total - len(rejected),
        "rejected": len(rejected),
        "rejected_reasons": dict(Counter(reason_kind(r) for r in rejected.values())),
    }


def _finish_report(report: dict, sequences: list[TrainingSequence]) -> dict:
    report["chains"] = len(sequences)
    report["tokens"] = sum(len(s.token_ids) for s in sequences)
    report["trainable_tokens"] = sum(s.trainable_tokens for s in sequences)
    return report


def _label(record: CompletionRecord) -> int:
    return record.completion_id if record.completion_id is not None else record.seq


# --- per_request -------------------------------------------------------------------------


def per_request(records: Iterable[CompletionRecord], vocab_size: int | None = None) -> BuildResult:
    """One sequence per valid completion: prompt (mask 0) + sampled ids (mask 1), with the
    completion's routes and a -1 row for its last sampled token (`app.training.chain_routes`).

    Returns a `BuildResult` whose report has `completions`, `accepted`, `rejected`,
    `rejected_reasons`, `chains` (= sequences), `completions_merged` (always 0),
    `chains_cut` (always 0), `tokens` and `trainable_tokens`; with routed experts also
    `routed_chains` / `unrouted_chains`.
    """
    accepted, rejected, total = _accept(records, vocab_size)
    sequences = []
    for record in accepted:
        prompt, sampled = list(record.prompt_ids), list(record.sampled_ids)
        sequences.append(
            TrainingSequence(
                token_ids=prompt + sampled,
                loss_mask=[0] * len(prompt) + [1] * len(sampled),
                logprobs=[0.0] * len(prompt) + [float(x) for x in record.logprobs],
                completions=[_label(record)],
                spans=[(len(prompt), len(prompt) + len(sampled))],
                policy_versions=[record.policy_version],
                finish_reasons=[record.finish_reason],
                sampling=[record.sampling],
                version_runs=[_runs(record)],
                routes=ChainRoutes(_routes(record)).close(len(prompt) + len(sampled)),
            )
        )
    report = _base_report("per_request", total, rejected)
    report.update(completions_merged=0, chains_cut=0, cut_reasons={})
    routes_report(report, any(r.routes is not None for r in accepted), [s.routes is not None for s in sequences])
    return BuildResult(sequences, _finish_report(report, sequences), rejected)


# --- prefix_merging ----------------------------------------------------------------------

# Why a completion started a new chain instead of extending its closest open chain.
CUT_REASONS = {
    "context_diverged": "the prompt departs from the chain inside its earlier context "
    "(context compaction, a sub-agent or parallel agent, an edited system prompt or tool list)",
    "assistant_turn_rerendered": "the prompt holds the chain's last prompt but not its sampled ids "
    "verbatim (re-tokenized text, reformatted tool call, stripped thinking)",
    "branched": "the prompt ends inside the chain (a retry or parallel call from an earlier point)",
}


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: chains are long and usually agree for thousands of tokens.
    step = 256
    while i + step <= n and list(a[i : i + step]) == list(b[i : i + step]):
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class _Chain:
    sequence: TrainingSequence
    prompt_len: int  # length of the last merged completion's prompt
    routes: ChainRoutes

    @property
    def stream(self) -> list[int]:
        return self.sequence.token_ids


def _runs(record: CompletionRecord) -> list | None:
    """The record's per-token version runs when it spans several versions, else None (its one
    `policy_version` says it all, and old rows stay as they were stored)."""
    runs = record.policy_versions
    return [list(run) for run in runs] if runs and len(runs) > 1 else None


def _routes(record: CompletionRecord) -> np.ndarray | None:
    """The record's routes when they cover its prompt and sampled tokens but the last, else None."""
    return fitting(record.routes, len(record.prompt_ids) + len(record.sampled_ids))


def _start_chain(record: CompletionRecord) -> _Chain:
    prompt, sampled = list(record.prompt_ids), list(record.sampled_ids)
    seq = TrainingSequence(
        token_ids=prompt + sampled,
        loss_mask=[0] * len(prompt) + [1] * len(sampled),
        logprobs=[0.0] * len(prompt) + [float(x) for x in record.logprobs],
        completions=[_label(record)],
        spans=[(len(prompt), len(prompt) + len(sampled))],
        policy_versions=[record.policy_version],
        finish_reasons=[record.finish_reason],
        sampling=[record.sampling],
        version_runs=[_runs(record)],
    )
    return _Chain(seq, len(prompt), ChainRoutes(_routes(record)))


def _extend_chain(chain: _Chain, record: CompletionRecord) -> None:
    seq = chain.sequence
    prompt, sampled = record.prompt_ids, list(record.sampled_ids)
    chain.routes.extend(_routes(record), len(seq.token_ids) - 1)  # the chain holds rows [0, len - 1)
    between = list(prompt[len(seq.token_ids) :])  # tool results, template glue: context only
    seq.token_ids.extend(between)
    seq.loss_mask.extend([0] * len(between))
    seq.logprobs.extend([0.0] * len(between))
    start = len(seq.token_ids)
    seq.token_ids.extend(sampled)
    seq.loss_mask.extend([1] * len(sampled))
    seq.logprobs.extend(float(x) for x in record.logprobs)
    seq.completions.append(_label(record))
    seq.spans.append((start, start + len(sampled)))
    seq.policy_versions.append(record.policy_version)
    seq.finish_reasons.append(record.finish_reason)
    seq.sampling.append(record.sampling)
    seq.version_runs.append(_runs(record))
    chain.prompt_len = len(prompt)


def _cut_reason(chains: list[_Chain], prompt: Sequence[int]) -> tuple[str, int, int]:
    """Classify why `prompt` extends none of `chains`: (reason, closest chain, diverged_at)."""
    best, best_lcp = 0, -1
    for index, chain in enumerate(chains):
        lcp = _common_prefix(chain.stream, prompt)
        if lcp > best_lcp:
            best, best_lcp = index, lcp
    chain = chains[best]
    if best_lcp == len(prompt):
        return "branched", best, best_lcp
    if best_lcp < chain.prompt_len:
        return "context_diverged", best, best_lcp
    return "assistant_turn_rerendered", best, best_lcp


def prefix_merging(records: Iterable[CompletionRecord], vocab_size: int | None = None) -> BuildResult:
    """Merge an episode's completions into chains of exact token continuity.

    Completions are taken in `seq` order.  A completion extends the open chain whose whole
    token stream (last prompt ids + last sampled ids) is a prefix of its `prompt_ids`, the
    longest such stream winning; otherwise it starts a new chain and the closest chain's
    divergence is classified with `CUT_REASONS`.  Chains stay open after a cut, so a parent
    agent resumes its chain after a sub-agent's calls.  A rejected completion is skipped; if
    the next prompt still extends the chain, its tokens become mask-0 context.

    Report keys: those of `per_request` plus `completions_merged` (completions appended to
    an existing chain), `chains_cut` (chains started because a prompt did not extend any
    open chain) and `cut_reasons` (counts per `CUT_REASONS` key), `new_chains` (one entry
    per cut: completion, reason, closest chain index, token offset where it diverged); with
    routed experts also `routed_chains` / `unrouted_chains`.

    Routes merge by `app.training.chain_routes`' rule: positions already in the chain keep the
    rows first recorded, an extending completion supplies those it adds (the previous last
    sampled token's, the `between` tokens', its own sampled tokens'), the last token gets -1.
    """
    accepted, rejected, total = _accept(records, vocab_size)
    chains: list[_Chain] = []
    merged = 0
    cuts: list[dict] = []
    for record in accepted:
        prompt = record.prompt_ids
        target, target_len = None, -1
        for chain in chains:
            n = len(chain.stream)
            if n <= len(prompt) and n > target_len and _common_prefix(chain.stream, prompt) == n:
                target, target_len = chain, n
        if target is not None:
            _extend_chain(target, record)
            merged += 1
            continue
        if chains:
            reason, closest, at = _cut_reason(chains, prompt)
            cuts.append({"completion": _label(record), "reason": reason, "closest_chain": closest, "diverged_at": at})
        chains.append(_start_chain(record))
    for chain in chains:
        chain.sequence.routes = chain.routes.close(len(chain.stream))
    sequences = [chain.sequence for chain in chains]
    report = _base_report("prefix_merging", total, rejected)
    report.update(
        completions_merged=merged,
        chains_cut=len(cuts),
        cut_reasons=dict(Counter(cut["reason"] for cut in cuts)),
        new_chains=cuts,
    )
    routes_report(report, any(r.routes is not None for r in accepted), [s.routes is not None for s in sequences])
    return BuildResult(sequences, _finish_report(report, sequences), rejected)


def build(builder: str, records: Iterable[CompletionRecord], vocab_size: int | None = None) -> BuildResult:
    """Run the builder named `builder` (one of `BUILDERS`); raises ValueError for others."""
    if builder == "prefix_merging":
        return prefix_merging(records, vocab_size)
    if builder == "per_request":
        return per_request(records, vocab_size)
    raise ValueError(f"unknown trajectory builder {builder!r}; choose one of {', '.join(BUILDERS)}")


# --- the sampling transform per token ----------------------------------------------------


@dataclass(frozen=True)
class SequenceTransform:
    """The sampling transform of every token of one sequence, for the trainer's scoring.

    All [T] over the sequence's tokens (values at loss-mask-0 positions are the identity and
    unused): `temperature` float (1.0: none; greedy tokens carry 1.0, as their logprobs are
    untransformed), `support` int (|K|; 0: whole vocabulary; -1: not reported by the engine,
    derived by the trainer from `top_k`/`top_p`), `top_k` int (0: off), `top_p` float.
    """

    temperature: list[float]
    support: list[int]
    top_k: list[int]
    top_p: list[float]


def sequence_transform(length: int, spans: Sequence[Sequence[int]],
                       sampling: Sequence[Mapping | None] | None) -> SequenceTransform | None:
    """Per-token transform of a sequence of `length` tokens whose sampled `spans` ([start, end))
    were drawn under `sampling` (one record or None per span, `app.proxy.sampling`).

    Returns None when every span is the identity (the trainer then scores as before).
    Raises ValueError when `sampling` and `spans` do not line up.
    """
    if not sampling or all(item is None for item in sampling):
        return None
    if len(sampling) != len(spans):
        raise ValueError(f"{len(sampling)} sampling records for {len(spans)} spans")
    temperature, support = [1.0] * length, [0] * length
    top_k, top_p = [0] * length, [1.0] * length
    for (start, end), item in zip(spans, sampling):
        if item is None:
            continue
        sizes = item.get("support")
        truncated = sizes is not None or int(item.get("top_k") or 0) > 0 or float(item.get("top_p", 1.0)) < 1.0
        for offset, t in enumerate(range(start, end)):
            temperature[t] = float(item["temperature"])
            top_k[t], top_p[t] = int(item.get("top_k") or 0), float(item.get("top_p", 1.0))
            if truncated:
                size = sizes[offset] if sizes is not None else None
                support[t] = int(size) if size is not None else -1
    return SequenceTransform(temperature, support, top_k, top_p)
