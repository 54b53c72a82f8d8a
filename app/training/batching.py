"""Micro-batches under a token budget: sequences packed into one row, or padded one per row.

Packed (`packing=True`, the trainer's default): sequences sorted longest first are placed
first-fit into micro-batches of at most `micro_batch_tokens` tokens; each micro-batch is one
row [1, sum T_i] with `position_ids` restarting at 0 for every sequence and its sequences'
lengths (`segment_lengths`), from which the trainer builds the document mask
(`app.training.packing`: a flex-attention BlockMask, or a dense block-diagonal mask under
sdpa/eager; flash-attention takes cu_seqlens from the position ids), so each token attends
only to earlier tokens of its own sequence.  No padding is computed.
Raffel et al. 2020 (T5, arXiv:1910.10683) introduced packing; position restarts and masking
across boundaries as in Krell et al. 2021, "Efficient Sequence Packing without
Cross-contamination" (arXiv:2107.02027).

Padded (`packing=False`): sequences sorted longest first are grouped greedily into
micro-batches whose padded size (rows x longest row) stays within `micro_batch_tokens`; one
sequence per row, attention cost sum(T_i^2) with plain causal kernels.

Either way a sequence longer than the budget gets a micro-batch of its own, and the
padding fraction of a step is 1 - sum(tokens) / sum(padded_tokens) over its micro-batches
(`padding_fraction`).

With routing replay (`TrainingConfig.routing_replay`) every sequence carries the routes the
engine recorded, `[T, layers, top_k]` expert ids; a micro-batch holds them laid out exactly as
its tokens (`MicroBatch.routes`, one row per input position, row-major as the MoE router flattens
`[B, T]`), so a packed row replays each of its sequences' own routes.  Positions without a
recorded route (a sequence's last token, whose output scores no logit, and padding) get the
experts 0..top_k-1: any valid distinct ids do, since nothing trained reads their outputs.

Each micro-batch carries its trainable tokens' loss weights (`aggregation_weights`: token-level
or per-episode sequence-level means over the whole step), which `grpo.policy_loss` sums over.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

import numpy as np
import torch

from app.runconfig import LOSS_AGGREGATIONS
from app.training.trajectories import SequenceTransform


@dataclass
class StepSequence:
    """One training sequence of a step with its episode's advantage.

    `token_ids` int [T]; `loss_mask` 0/1 [T]; `logprobs` float nats [T] (rollout logprob
    where the mask is 1); `advantage` float; `episode_id` for reporting; `transform` the
    sampling transform of each token (None: the identity, scored as plain log softmax);
    `policy_lag` how many policy versions the oldest weights that sampled any of its tokens lag
    the trainer's (0: on-policy, so its logprob gap measures sampling-vs-training mismatch alone);
    `token_lags` int [T] the same per position, from the per-token versions the gateway recorded
    (a chain that spans an in-flight weight update has tokens of several lags; 0 on context
    tokens; None: every token lags `policy_lag`).  `routes` int16 [T, layers, top_k]: the expert
    ids the engine's MoE layers chose at each position (-1 at the last token, which ran through
    no forward that scored anything; `Trajectory.routed_experts`), for routing replay; None
    without.
    """

    token_ids: Sequence[int]
    loss_mask: Sequence[int]
    logprobs: Sequence[float]
    advantage: float
    episode_id: int | None = None
    transform: SequenceTransform | None = None
    policy_lag: int = 0
    token_lags: Sequence[int] | None = None
    routes: np.ndarray | None = None

    @property
    def trainable(self) -> int:
        return int(sum(self.loss_mask))


@dataclass
class MicroBatch:
    """Tensors for one forward/backward pass.

    `input_ids`: int64 [B, T]; padded: `attention_mask` int64 [B, T] and `position_ids` None;
    packed: B = 1, `position_ids` int64 [1, T] (restarting per sequence), `attention_mask`
    None and `segment_lengths` (tokens of each packed sequence, in row order).  Per trainable token (N of them): `rows`,
    `cols` int64 [N] (position predicting it), `targets` int64 [N], `rollout_logprobs`
    float32 [N], `advantages` float32 [N], `weights` float32 [N] (loss aggregation weights),
    `sequence_index` int64 [N] (index into the step's sequence list), `token_lag` int64 [N]
    (policy versions by which the weights that sampled the token lag the trainer's:
    `StepSequence.token_lags`, else its sequence's `policy_lag`).  With a sampling
    transform on any of its sequences (else all four None): `temperature` float32 [N],
    `support` int64 [N], `top_k` int64 [N], `top_p` float32 [N] (`SequenceTransform`; identity
    values for tokens of sequences without one), what `app.engines.transform.processed_logprobs` takes.
    With a distillation teacher's top-k (`app.training.opd.apply_token_advantages`):
    `teacher_top_ids` int64 [N, k], `teacher_top_logprobs` float32 [N, k], `teacher_top_rows`
    bool [N] (which tokens have them).
    Under routing replay: `routes` int64 [B * T, layers, top_k], the forced experts of every
    input position in row-major order (module docstring), and `route_recorded` bool [B * T]
    (the rows whose routes the engine recorded; False at fillers), else both None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor
    sequence_index: torch.Tensor
    tokens: int  # real tokens, padding excluded
    padded_tokens: int  # B * T
    position_ids: torch.Tensor | None = None
    token_lag: torch.Tensor | None = None  # int64 [N]; set by make_micro_batches
    segment_lengths: tuple[int, ...] | None = None
    temperature: torch.Tensor | None = None
    support: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    # on-policy distillation by forward KL to the teacher's top-k (`app.training.opd`), else None
    teacher_top_ids: torch.Tensor | None = None
    teacher_top_logprobs: torch.Tensor | None = None
    teacher_top_rows: torch.Tensor | None = None
    routes: torch.Tensor | None = None
    route_recorded: torch.Tensor | None = None

    def transform(self) -> dict:
        """The sampling-transform keyword arguments of `app.training.policy.token_logprobs`."""
        return {"temperature": self.temperature, "support": self.support, "top_k": self.top_k, "top_p": self.top_p}

    def to(self, device: torch.device) -> "MicroBatch":
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return MicroBatch(**moved)


def zero_advantage_indices(sequences: Sequence[StepSequence]) -> set[int]:
    """Indices of the sequences whose every trainable token has advantage 0 (an episode advantage
    of 0, and for per-token advantages, `token_advantages`, all 0 at trainable positions) and
    no teacher top-k tokens (`app.training.opd.OPDSequence.top_ids`)."""
    out = set()
    for i, seq in enumerate(sequences):
        per_token = getattr(seq, "token_advantages", None)
        if getattr(seq, "top_ids", None):
            continue  # the teacher's top-k term trains it whatever its advantages
        if per_token:
            if all(a == 0.0 for a, m in zip(per_token, seq.loss_mask) if m):
                out.add(i)
        elif seq.advantage == 0.0:
            out.add(i)
    return out


def make_micro_batches(
    sequences: Sequence[StepSequence], micro_batch_tokens: int, aggregation: str, pad_id: int = 0,
    packing: bool = False, leave_out: Collection[int] = (),
) -> list[MicroBatch]:
    """Group `sequences` into packed or padded micro-batches (see the module docstring).

    Sequences without trainable tokens are skipped.  Aggregation weights are computed over
    the whole step (`aggregation` "token" or "sequence"; for "sequence" the sample is the
    episode, `StepSequence.episode_id`, so all chains of one episode share one weight; a
    sequence without an episode id is its own sample), so the micro-batch losses sum to the
    step's loss.  `leave_out`: indices of sequences counted in those weights but put in no
    micro-batch (zero-advantage chains: the step's weights of the others are unchanged).
    Returns the micro-batches, longest sequences first.
    Raises ValueError when a sequence's first token is trainable (nothing predicts it).
    """
    usable = [i for i, s in enumerate(sequences) if s.trainable > 0]
    if not usable:
        return []
    step_tokens = sum(sequences[i].trainable for i in usable)
    episode_of = {i: (("episode", sequences[i].episode_id) if sequences[i].episode_id is not None else ("sequence", i))
                  for i in usable}
    episode_tokens: dict = {}
    for i in usable:
        episode_tokens[episode_of[i]] = episode_tokens.get(episode_of[i], 0) + sequences[i].trainable
    totals = {i: episode_tokens[episode_of[i]] for i in usable}
    step_samples = len(episode_tokens)
    order = sorted((i for i in usable if i not in leave_out), key=lambda i: len(sequences[i].token_ids), reverse=True)
    groups: list[list[int]] = []
    if packing:
        room: list[int] = []  # tokens still free in each group (first fit, longest first)
        for i in order:
            n = len(sequences[i].token_ids)
            slot = next((g for g, free in enumerate(room) if n <= free), None)
            if slot is None:
                groups.append([i])
                room.append(micro_batch_tokens - n)
            else:
                groups[slot].append(i)
                room[slot] -= n
        return [_tensorize_packed(sequences, g, aggregation, step_tokens, step_samples, totals) for g in groups]
    for i in order:
        if groups:
            head = len(sequences[groups[-1][0]].token_ids)  # longest row of the open group
            if (len(groups[-1]) + 1) * head <= micro_batch_tokens:
                groups[-1].append(i)
                continue
        groups.append([i])
    return [_tensorize(sequences, g, aggregation, step_tokens, step_samples, totals, pad_id) for g in groups]


def _transform_tensors(sequences, indices, positions: list[torch.Tensor]) -> dict:
    """`MicroBatch` transform fields for sequences `indices` at their trainable `positions`."""
    if all(sequences[i].transform is None for i in indices):
        return {}
    parts: dict[str, list[torch.Tensor]] = {"temperature": [], "support": [], "top_k": [], "top_p": []}
    kinds = {"temperature": torch.float32, "support": torch.long, "top_k": torch.long, "top_p": torch.float32}
    identity = {"temperature": 1.0, "support": 0, "top_k": 0, "top_p": 1.0}
    for i, where in zip(indices, positions):
        transform = sequences[i].transform
        for name, kind in kinds.items():
            if transform is None:
                parts[name].append(torch.full((where.numel(),), identity[name], dtype=kind))
            else:
                parts[name].append(torch.tensor(getattr(transform, name), dtype=kind)[where])
    return {name: torch.cat(values) for name, values in parts.items()}


def _token_lags(seq: StepSequence, positions: torch.Tensor) -> torch.Tensor:
    """The lag (int64) of each trainable position of `seq`: its `token_lags`, else its `policy_lag`.
    Raises ValueError when `token_lags` is not one entry per token."""
    if seq.token_lags is None:
        return torch.full((positions.numel(),), int(seq.policy_lag), dtype=torch.long)
    if len(seq.token_lags) != len(seq.token_ids):
        raise ValueError(f"token_lags holds {len(seq.token_lags)} entries for {len(seq.token_ids)} tokens "
                         f"(episode {seq.episode_id})")
    return torch.tensor(list(seq.token_lags), dtype=torch.long)[positions]


def _route_rows(sequences, indices, width: int | None = None) -> dict:
    """`MicroBatch.routes` and `route_recorded` of sequences `indices`: each sequence's routes,
    its unrouted rows (-1: the last token) set to experts 0..top_k-1, padded to `width` rows with
    those (padded micro-batches; None: packed, back to back).  {} when no sequence has routes.
    Raises ValueError when only some have routes, or their layer/top-k shapes differ."""
    present = [sequences[i].routes is not None for i in indices]
    if not any(present):
        return {}
    if not all(present):
        missing = [sequences[i].episode_id for i, p in zip(indices, present) if not p]
        raise ValueError(f"routing replay: sequences of episodes {missing} have no routes, others in their "
                         "micro-batch do")
    shapes = {tuple(sequences[i].routes.shape[1:]) for i in indices}
    if len(shapes) != 1:
        raise ValueError(f"routing replay: sequences of one micro-batch have routes of shapes {sorted(shapes)}")
    layers, top_k = shapes.pop()
    filler = torch.arange(top_k, dtype=torch.long).expand(layers, top_k)
    parts, recorded = [], []
    for i in indices:
        routes = torch.as_tensor(np.asarray(sequences[i].routes), dtype=torch.long)
        unrouted = (routes < 0).any(dim=-1, keepdim=True)
        routes = torch.where(unrouted, filler, routes)
        recorded.append(~unrouted.any(dim=1)[:, 0])
        if width is not None and routes.shape[0] < width:
            recorded.append(torch.zeros(width - routes.shape[0], dtype=torch.bool))
            routes = torch.cat([routes, filler.expand(width - routes.shape[0], layers, top_k)])
        parts.append(routes)
    return {"routes": torch.cat(parts), "route_recorded": torch.cat(recorded)}


def _trainable_positions(seq: StepSequence) -> torch.Tensor:
    mask = torch.tensor(list(seq.loss_mask), dtype=torch.bool)
    positions = torch.nonzero(mask, as_tuple=True)[0]
    if positions.numel() and int(positions[0]) == 0:
        raise ValueError("a sequence's first token cannot be trainable (nothing precedes it)")
    return positions


def _tensorize_packed(sequences, indices, aggregation, step_tokens, step_samples, totals) -> MicroBatch:
    ids, pos, cols, targets, rollout, advantages, seq_index, lengths = [], [], [], [], [], [], [], []
    trainable, lags = [], []
    offset = 0
    for i in indices:
        seq = sequences[i]
        tokens = torch.tensor(list(seq.token_ids), dtype=torch.long)
        n = int(tokens.numel())
        positions = _trainable_positions(seq)
        trainable.append(positions)
        ids.append(tokens)
        pos.append(torch.arange(n, dtype=torch.long))
        cols.append(offset + positions - 1)
        targets.append(tokens[positions])
        rollout.append(torch.tensor(list(seq.logprobs), dtype=torch.float32)[positions])
        advantages.append(torch.full((positions.numel(),), float(seq.advantage), dtype=torch.float32))
        seq_index.append(torch.full_like(positions, i))
        lags.append(_token_lags(seq, positions))
        lengths.append(int(positions.numel()))
        offset += n
    weights = torch.tensor(aggregation_weights(lengths, aggregation, step_tokens, step_samples,
                                               [totals[i] for i in indices]), dtype=torch.float32)
    cols_t = torch.cat(cols)
    return MicroBatch(
        input_ids=torch.cat(ids).unsqueeze(0),
        attention_mask=None,
        rows=torch.zeros_like(cols_t),
        cols=cols_t,
        targets=torch.cat(targets),
        rollout_logprobs=torch.cat(rollout),
        advantages=torch.cat(advantages),
        weights=weights,
        sequence_index=torch.cat(seq_index),
        tokens=offset,
        padded_tokens=offset,
        position_ids=torch.cat(pos).unsqueeze(0),
        token_lag=torch.cat(lags),
        segment_lengths=tuple(len(sequences[i].token_ids) for i in indices),
        **_route_rows(sequences, indices),
        **_transform_tensors(sequences, indices, trainable),
    )


def _tensorize(sequences, indices, aggregation, step_tokens, step_samples, totals, pad_id) -> MicroBatch:
    width = max(len(sequences[i].token_ids) for i in indices)
    input_ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(indices), width), dtype=torch.long)
    rows, cols, targets, rollout, advantages, seq_index, lengths = [], [], [], [], [], [], []
    trainable, lags = [], []
    tokens = 0
    for row, i in enumerate(indices):
        seq = sequences[i]
        n = len(seq.token_ids)
        tokens += n
        input_ids[row, :n] = torch.tensor(list(seq.token_ids), dtype=torch.long)
        attention_mask[row, :n] = 1
        positions = _trainable_positions(seq)
        trainable.append(positions)
        rows.append(torch.full_like(positions, row))
        cols.append(positions - 1)
        targets.append(input_ids[row, positions])
        rollout.append(torch.tensor(list(seq.logprobs), dtype=torch.float32)[positions])
        advantages.append(torch.full((positions.numel(),), float(seq.advantage), dtype=torch.float32))
        seq_index.append(torch.full_like(positions, i))
        lags.append(_token_lags(seq, positions))
        lengths.append(int(positions.numel()))
    weights = torch.tensor(aggregation_weights(lengths, aggregation, step_tokens, step_samples,
                                               [totals[i] for i in indices]), dtype=torch.float32)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        rows=torch.cat(rows),
        cols=torch.cat(cols),
        targets=torch.cat(targets),
        rollout_logprobs=torch.cat(rollout),
        advantages=torch.cat(advantages),
        weights=weights,
        sequence_index=torch.cat(seq_index),
        tokens=tokens,
        padded_tokens=len(indices) * width,
        token_lag=torch.cat(lags),
        **_route_rows(sequences, indices, width),
        **_transform_tensors(sequences, indices, trainable),
    )


def padding_fraction(batches: Sequence[MicroBatch]) -> float:
    """Share of the computed token slots that are padding: 1 - sum(tokens) / sum(padded_tokens)
    over `batches` (0.0 for packed micro-batches, and for none)."""
    padded = sum(mb.padded_tokens for mb in batches)
    return 1.0 - sum(mb.tokens for mb in batches) / padded if padded else 0.0


def aggregation_weights(
    sequence_lengths: Sequence[int], mode: str, step_tokens: int, step_episodes: int,
    episode_lengths: Sequence[int] | None = None,
) -> list[float]:
    """Per-token loss weights for the trainable tokens of some sequences.

    `sequence_lengths` holds the trainable-token count of each sequence in a micro-batch;
    the result is a flat list, one weight per trainable token in the same order.
    `"token"`: every token of the whole step weighs 1/`step_tokens` (DAPO token-level mean,
    long chains are not down-weighted per token).  `"sequence"`: GRPO's per-sample mean, then
    mean over the step's samples, where a sample is an *episode*: each token weighs
    1/(its episode's trainable tokens over all of its chains x `step_episodes`), so an episode
    weighs 1/`step_episodes` in all however many chains prefix merging made of it (one chain or
    several after a non-extending turn give the same loss).  `episode_lengths[i]` is that
    per-episode count for sequence i (None: each sequence is its own episode).
    Raises ValueError for an unknown `mode` or mismatched lengths.
    """
    if mode == "token":
        return [1.0 / step_tokens] * sum(sequence_lengths)
    if mode == "sequence":
        totals = list(sequence_lengths) if episode_lengths is None else list(episode_lengths)
        if len(totals) != len(sequence_lengths):
            raise ValueError("episode_lengths needs one entry per sequence")
        out: list[float] = []
        for n, total in zip(sequence_lengths, totals):
            out.extend([1.0 / (total * step_episodes)] * n)
        return out
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(LOSS_AGGREGATIONS)}")
