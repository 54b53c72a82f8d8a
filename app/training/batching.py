"""Micro-batches: padded rows of whole sequences under a token budget.

Sequences are sorted longest first and packed greedily into micro-batches whose padded size
(rows x longest row) stays within `micro_batch_tokens`; a sequence longer than the budget gets
a micro-batch of its own.  Sorting by length keeps padding small, and one sequence per row
keeps attention cost at sum(T_i^2) with plain (sdpa) attention; packing several sequences
into one row would need a block-diagonal mask that costs (sum T_i)^2 without varlen kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from app.training.grpo import aggregation_weights


@dataclass
class StepSequence:
    """One training sequence of a step with its episode's advantage.

    `token_ids` int [T]; `loss_mask` 0/1 [T]; `logprobs` float nats [T] (rollout logprob
    where the mask is 1); `advantage` float; `episode_id` for reporting.
    """

    token_ids: Sequence[int]
    loss_mask: Sequence[int]
    logprobs: Sequence[float]
    advantage: float
    episode_id: int | None = None

    @property
    def trainable(self) -> int:
        return int(sum(self.loss_mask))


@dataclass
class MicroBatch:
    """Tensors for one forward/backward pass.

    `input_ids`, `attention_mask`: int64 [B, T]; per trainable token (N of them): `rows`,
    `cols` int64 [N] (position predicting it), `targets` int64 [N], `rollout_logprobs`
    float32 [N], `advantages` float32 [N], `weights` float32 [N] (loss aggregation weights),
    `sequence_index` int64 [N] (index into the step's sequence list).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor
    sequence_index: torch.Tensor
    tokens: int  # real tokens, padding excluded
    padded_tokens: int  # B * T

    def to(self, device: torch.device) -> "MicroBatch":
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return MicroBatch(**moved)


def make_micro_batches(
    sequences: Sequence[StepSequence], micro_batch_tokens: int, aggregation: str, pad_id: int = 0
) -> list[MicroBatch]:
    """Group `sequences` into padded micro-batches (see the module docstring).

    Sequences without trainable tokens are skipped.  Aggregation weights are computed over
    the whole step (`aggregation` "token" or "sequence"), so the micro-batch losses sum to
    the step's loss.  Returns the micro-batches, longest rows first.
    """
    usable = [i for i, s in enumerate(sequences) if s.trainable > 0]
    if not usable:
        return []
    step_tokens = sum(sequences[i].trainable for i in usable)
    order = sorted(usable, key=lambda i: len(sequences[i].token_ids), reverse=True)
    groups: list[list[int]] = []
    for i in order:
        if groups:
            head = len(sequences[groups[-1][0]].token_ids)  # longest row of the open group
            if (len(groups[-1]) + 1) * head <= micro_batch_tokens:
                groups[-1].append(i)
                continue
        groups.append([i])
    return [_tensorize(sequences, g, aggregation, step_tokens, len(usable), pad_id) for g in groups]


def _tensorize(sequences, indices, aggregation, step_tokens, step_sequences, pad_id) -> MicroBatch:
    width = max(len(sequences[i].token_ids) for i in indices)
    input_ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(indices), width), dtype=torch.long)
    rows, cols, targets, rollout, advantages, seq_index, lengths = [], [], [], [], [], [], []
    tokens = 0
    for row, i in enumerate(indices):
        seq = sequences[i]
        n = len(seq.token_ids)
        tokens += n
        input_ids[row, :n] = torch.tensor(list(seq.token_ids), dtype=torch.long)
        attention_mask[row, :n] = 1
        mask = torch.tensor(list(seq.loss_mask), dtype=torch.bool)
        positions = torch.nonzero(mask, as_tuple=True)[0]
        if positions.numel() and int(positions[0]) == 0:
            raise ValueError("a sequence's first token cannot be trainable (nothing precedes it)")
        rows.append(torch.full_like(positions, row))
        cols.append(positions - 1)
        targets.append(input_ids[row, positions])
        rollout.append(torch.tensor(list(seq.logprobs), dtype=torch.float32)[positions])
        advantages.append(torch.full((positions.numel(),), float(seq.advantage), dtype=torch.float32))
        seq_index.append(torch.full_like(positions, i))
        lengths.append(int(positions.numel()))
    weights = torch.tensor(aggregation_weights(lengths, aggregation, step_tokens, step_sequences), dtype=torch.float32)
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
    )
