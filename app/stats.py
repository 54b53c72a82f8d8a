"""Evaluation statistics, one definition each: pass@1, pass@k, the Wilson interval, the clustered
bootstrap, and the percentile of the run summaries.

Used by the CLI (`python -m app compare`, `learn`), the dashboard's compare page and the run
summary.  Pure functions over resolved flags; nothing here reads SQL or the API.

* pass@1 of a run: the mean over instances of the fraction of that instance's samples that
  resolved it (Chen et al. 2021, arXiv:2107.03374, eq. 1 with k = 1, averaged over instances).
* pass@k: Chen et al.'s unbiased estimator 1 - C(n-c, k) / C(n, k) from n samples of which c
  resolved (ibid. §2.1).  `pass_at_k` means this estimator everywhere in Turnstile; "some
  sample resolved the instance" is called *solved*.
* Wilson score interval of a binomial rate (Wilson 1927), at `Z_95`.
* Clustered bootstrap: samples of one instance are correlated, so each replicate draws
  instances with replacement, then each drawn instance's samples with replacement (Efron &
  Tibshirani 1993, ch. 13; for LLM evals: Miller 2024, "Adding Error Bars to Evals",
  arXiv:2411.00640 §2.2).  The difference after - before is *paired*: one draw of instances
  serves both runs, so instance difficulty cancels.  95% intervals are the 2.5th and 97.5th
  percentiles of the replicates.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Mapping, Sequence

import numpy as np

Samples = Mapping[str, Sequence[bool]]  # instance id -> resolved flag of each sample
Z_95 = NormalDist().inv_cdf(0.975)  # 1.959964...: the two-sided 95% normal quantile


def pass_at_k(n: int, c: int, k: int) -> float | None:
    """Chen et al.'s unbiased pass@k from `n` samples of which `c` resolved; None when n < k or k < 1.

    1 - C(n-c, k) / C(n, k), computed exactly with integer binomials (a float in [0, 1]).
    """
    if n < k or k <= 0:
        return None
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_1(samples: Samples) -> float:
    """Mean over instances of each instance's resolved fraction.  Raises ValueError if an instance has no sample."""
    if not samples:
        raise ValueError("no instance has a sample")
    rates = []
    for name, flags in samples.items():
        if not flags:
            raise ValueError(f"instance {name!r} has no sample")
        rates.append(sum(map(bool, flags)) / len(flags))
    return float(np.mean(rates))


def wilson(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval (low, high) of `successes` out of `n` (95% at the default z).

    (0.0, 1.0) for n = 0: the interval's limit as n -> 0, i.e. nothing is known.  Preferred to
    the normal approximation because it stays inside [0, 1] and stays open at 0 of n or n of n,
    where a percentile bootstrap collapses to [p, p]: 0 of 18 gives [0, 0] there, [0, 0.176] here.
    Raises ValueError when successes is outside [0, n].
    """
    if not 0 <= successes <= max(n, 0):
        raise ValueError(f"successes must be within [0, {n}], not {successes}")
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank `q`-quantile (q in [0, 1]) of `values`: the sorted value at index
    round(q * (len - 1)); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


@dataclass(frozen=True)
class Interval:
    """A point estimate and its 95% percentile-bootstrap interval (fractions in [0, 1]; a difference in [-1, 1])."""

    value: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.value:.3f} [{self.low:.3f}, {self.high:.3f}]"


@dataclass(frozen=True)
class Comparison:
    """pass@1 before and after, their difference, and the sample counts behind them."""

    before: Interval
    after: Interval
    difference: Interval
    instances: int
    samples_before: int
    samples_after: int
    replicates: int

    def to_dict(self) -> dict:
        return asdict(self)


def _replicate_rates(flags: list[np.ndarray], picks: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """pass@1 of each replicate: `picks` [R, I] instance indices; samples redrawn within each pick."""
    out = np.zeros(picks.shape[0])
    for col in range(picks.shape[1]):
        for idx in np.unique(picks[:, col]):
            rows = np.nonzero(picks[:, col] == idx)[0]
            f = flags[idx]
            draws = rng.integers(0, len(f), size=(len(rows), len(f)))
            out[rows] += f[draws].mean(axis=1)
    return out / picks.shape[1]


def compare_samples(before: Samples, after: Samples, *, replicates: int = 10000, seed: int = 0) -> Comparison:
    """Paired clustered bootstrap of pass@1 before/after over the instances both runs sampled.

    Raises ValueError when the runs share no instance or `replicates` < 100.
    """
    if replicates < 100:
        raise ValueError(f"replicates must be at least 100, not {replicates}")
    names = sorted(n for n in set(before) & set(after) if before[n] and after[n])
    if not names:
        raise ValueError("the two runs have no instance with samples in common")
    rng = np.random.default_rng(seed)
    fb = [np.asarray(before[n], dtype=float) for n in names]
    fa = [np.asarray(after[n], dtype=float) for n in names]
    picks = rng.integers(0, len(names), size=(replicates, len(names)))
    rb, ra = _replicate_rates(fb, picks, rng), _replicate_rates(fa, picks, rng)

    def interval(point: float, reps: np.ndarray) -> Interval:
        low, high = np.percentile(reps, [2.5, 97.5])
        return Interval(float(point), float(low), float(high))

    pb, pa = pass_at_1({n: before[n] for n in names}), pass_at_1({n: after[n] for n in names})
    return Comparison(before=interval(pb, rb), after=interval(pa, ra), difference=interval(pa - pb, ra - rb),
                      instances=len(names), samples_before=sum(len(before[n]) for n in names),
                      samples_after=sum(len(after[n]) for n in names), replicates=replicates)
