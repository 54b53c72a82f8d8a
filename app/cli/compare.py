"""`python -m app compare BEFORE AFTER`: pass@1 of two eval runs with 95% bootstrap intervals.

pass@1 of a run = the mean over instances of the fraction of that instance's samples that
resolved it (the unbiased pass@1 estimator of Chen et al. 2021, arXiv:2107.03374, eq. 1 with
k = 1, averaged over instances).  Samples of one instance are correlated, so the interval is
a *clustered* bootstrap (Efron & Tibshirani 1993, ch. 13; clustered error bars for LLM evals:
Miller 2024, "Adding Error Bars to Evals", arXiv:2411.00640 §2.2): each replicate draws
instances with replacement, then each drawn instance's samples with replacement.  The
difference after - before is *paired*: one draw of instances serves both runs (the same
held-out instances were evaluated before and after), so instance difficulty cancels.
95% intervals are the 2.5th and 97.5th percentiles of the replicates.

Every episode that ended counts as one sample: `completed` ones by their `resolved` flag, and
`failed` ones (harness failure, setup error) as not resolved: the reported metric is the
binary resolved rate of what the policy was asked to do.  Cancelled episodes are left out.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import numpy as np
from rich.table import Table

Samples = Mapping[str, Sequence[bool]]  # instance id -> resolved flag of each sample


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


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a binomial rate (Wilson 1927); (0.0, 1.0) for n = 0.

    Shown beside the bootstrap because a percentile bootstrap collapses to [p, p] when every
    sample has the same outcome (0 of 18 gives [0, 0]); Wilson's upper bound stays honest (0.176).
    """
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def samples_of(episodes: Sequence[Mapping]) -> dict[str, list[bool]]:
    """Resolved flags per instance from a run's episodes (API shape): completed by `resolved`, failed as False."""
    out: dict[str, list[bool]] = {}
    for ep in episodes:
        if ep.get("status") == "completed":
            out.setdefault(ep["instance_id"], []).append(bool(ep.get("resolved")))
        elif ep.get("status") == "failed":
            out.setdefault(ep["instance_id"], []).append(False)
    return out


def comparison_table(before_run: Mapping, after_run: Mapping, before: Samples, after: Samples, result: Comparison) -> Table:
    """The before/after table: pass@1 per instance, then overall with intervals and the difference."""
    def label(run: Mapping) -> str:
        model = run["config"].get("model", {})
        return f"run {run['id']} ({model.get('checkpoint') or model.get('name')})"

    table = Table(title=f"held-out pass@1: run {before_run['id']} (before) vs run {after_run['id']} (after)")
    for col in ("instance", f"before: {label(before_run)}", f"after: {label(after_run)}"):
        table.add_column(col)
    for name in sorted(set(before) | set(after)):
        table.add_row(name, *(f"{sum(d[name])}/{len(d[name])}" if d.get(name) else "-" for d in (before, after)))
    table.add_section()
    table.add_row("pass@1 [95% CI]", str(result.before), str(result.after))
    table.add_row("after - before [95% CI]", "", str(result.difference))
    table.add_row("instances / samples", f"{result.instances} / {result.samples_before}",
                  f"{result.instances} / {result.samples_after}")
    pooled = []
    for d in (before, after):
        flags = [f for name in sorted(set(before) & set(after)) for f in d[name]]
        low, high = wilson(sum(flags), len(flags))
        pooled.append(f"{sum(flags)}/{len(flags)} [{low:.3f}, {high:.3f}]")
    table.add_row("resolved samples [Wilson 95%]", *pooled)
    return table


def write_json(path: str, before_run: Mapping, after_run: Mapping, before: Samples, after: Samples, result: Comparison) -> None:
    """The comparison as JSON (what `learning.png` and the README table are made from)."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"before_run": before_run["id"], "after_run": after_run["id"], **result.to_dict(),
                   "per_instance": {"before": before, "after": after}}, fh, indent=2)
