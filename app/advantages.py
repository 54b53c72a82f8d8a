"""GRPO's group advantages, in plain Python (no torch): the trainer and the dashboard use the one definition.

* Group advantage A_i = (R_i - mean_g R) / std_g R: DeepSeekMath, Shao et al. 2024,
  arXiv:2402.03300, §4.1.2 (outcome supervision).  Leave-one-out baseline: Ahmadian et al.
  2024 (RLOO, arXiv:2402.14740).
"""
from __future__ import annotations

import math
from typing import Sequence

from app.runconfig import ADVANTAGE_MODES


def group_advantages(
    rewards: Sequence[float | None], mode: str = "mean", normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """Advantages of the episodes of one GRPO group.

    `rewards` [G] floats; None or NaN marks an episode that failed to produce a reward: it
    gets advantage 0.0 and is left out of the baseline (Polar §4.2 step 5).  `mode` is
    `"mean"` (A_i = R_i - mean R, DeepSeekMath) or `"leave_one_out"` (A_i = R_i - mean of the
    other rewards).  With `normalize_std`, advantages are divided by the group's sample
    standard deviation (+`eps`).  A group whose valid rewards are all equal, or that has
    fewer than two valid rewards, gets exactly 0.0 everywhere: it carries no signal, and
    dividing by a zero std would only amplify float noise.  Returns [G] floats.
    Raises ValueError for an unknown `mode`.
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; choose one of {', '.join(ADVANTAGE_MODES)}")
    valid = [i for i, r in enumerate(rewards) if r is not None and math.isfinite(r)]
    out = [0.0] * len(rewards)
    values = [float(rewards[i]) for i in valid]
    if len(values) < 2 or max(values) == min(values):
        return out
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    for i, v in zip(valid, values):
        adv = v - mean if mode == "mean" else v - (mean * n - v) / (n - 1)
        out[i] = adv / (std + eps) if normalize_std else adv
    return out
