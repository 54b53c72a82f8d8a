"""Trainer step timing shared by the step benches (`bench/zero_advantage_step.py`,
`bench/off_policy_prepass.py`): arms that differ only in their `TrainingConfig`, each step from
freshly loaded weights, the arms interleaved after one warm-up step so that every arm sees the
same background load; what a bench prints from it is its own."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from app.runconfig import TrainingConfig
from app.training.batching import StepSequence
from app.training.trainer import Trainer

# Rewrites the step's sequences for the freshly loaded trainer (e.g. its own logprobs as the rollout's).
Prepare = Callable[[Trainer, list[StepSequence]], list[StepSequence]]


@dataclass
class ArmTimes:
    """One arm's steps: `seconds` of each `Trainer.update` (wall clock, `time.perf_counter`), the
    metrics of its last step, and what `keep(trainer)` returned after it (None without `keep`)."""

    seconds: list[float] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    kept: Any = None


def timed_step(config: TrainingConfig, model_spec: str, seqs: list[StepSequence],
               prepare: Prepare | None = None) -> tuple[float, dict, Trainer]:
    """(seconds, metrics, trainer) of one `Trainer.update` of `seqs` (after `prepare`, untimed) on
    CPU from freshly loaded `model_spec` weights; only the update is timed."""
    trainer = Trainer.from_spec(config, model_spec, torch.device("cpu"))
    step = prepare(trainer, seqs) if prepare is not None else seqs
    t0 = time.perf_counter()
    metrics = trainer.update(step)
    return time.perf_counter() - t0, metrics, trainer


def interleaved_arms(arms: dict[str, TrainingConfig], model_spec: str, seqs: list[StepSequence], repeats: int, *,
                     prepare: Prepare | None = None, keep: Callable[[Trainer], Any] | None = None) -> dict[str, ArmTimes]:
    """Every arm's steps: one warm-up step of the first arm on `seqs[:1]` (first-call allocations
    are in no arm), then `repeats` rounds of one step per arm, in the order of `arms`."""
    first = next(iter(arms.values()))
    timed_step(first, model_spec, seqs[:1], prepare)
    out = {name: ArmTimes() for name in arms}
    for _ in range(repeats):
        for name, config in arms.items():
            seconds, metrics, trainer = timed_step(config, model_spec, seqs, prepare)
            out[name].seconds.append(seconds)
            out[name].metrics = metrics
            out[name].kept = keep(trainer) if keep is not None else None
    return out
