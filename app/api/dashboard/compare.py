"""An eval run's per-instance results and the comparison of two runs, read from SQL (statistics from `app.stats`).

pass@1 of an instance is the resolved fraction of its completed samples, with a 95% Wilson
interval; pass@k is Chen et al.'s unbiased estimate.  The paired difference of two runs is
the clustered bootstrap `app.stats.compare_samples` (the one `turnstile compare` prints),
over the instances both runs sampled.
"""
from __future__ import annotations

from sqlalchemy.orm import Session

from app.control import heldout
from app.stats import compare_samples, pass_at_k, wilson
from app.tables import Run

REPLICATES = 2000  # enough for a 95% percentile interval to ±0.01 on a page that answers at once


def _cell(flags: list[bool], k: int) -> dict:
    n, c = len(flags), sum(flags)
    return {"n": n, "c": c, "pass1": c / n if n else None, "pass1_ci": wilson(c, n) if n else None,
            "passk": pass_at_k(n, c, k)}


def _overall(samples: dict[str, list[bool]], k: int) -> dict:
    """Pooled pass@1 with its Wilson interval; pass@k as the mean of the instances' estimates,
    its interval over instances (solved instances of those graded)."""
    n = sum(len(f) for f in samples.values())
    c = sum(sum(f) for f in samples.values())
    estimates = [p for f in samples.values() if (p := pass_at_k(len(f), sum(f), k)) is not None]
    solved = sum(1 for f in samples.values() if any(f))
    return {"n": n, "c": c, "instances": len(samples), "pass1": c / n if n else None,
            "pass1_ci": wilson(c, n) if n else None,
            "passk": sum(estimates) / len(estimates) if estimates else None,
            "passk_ci": wilson(solved, len(samples)) if samples else None}


def _group_size(run: Run) -> int:
    return max(1, int((run.config or {}).get("group_size") or 1))


def eval_results(s: Session, run: Run) -> dict:
    """An eval (or collect) run's page section: {k, rows: [{instance, cell}], overall}; rows empty
    until a sample is graded."""
    k = _group_size(run)
    samples = heldout.samples(s, run.id)
    return {"k": k, "rows": [{"instance": name, "cell": _cell(f, k)} for name, f in sorted(samples.items())],
            "overall": _overall(samples, k) if samples else None}


def compare_warnings(a: Run, b: Run, names_a: set[str], names_b: set[str]) -> list[str]:
    """What makes the two runs' numbers less than comparable, one sentence each."""
    out = []
    for r in (a, b):
        if r.kind != "eval":
            out.append(f"run #{r.id} is a {r.kind} run, not an eval: its samples came from a policy that changed while it ran")
        if r.status != "completed":
            out.append(f"run #{r.id} is {r.status}: its results are partial")
    if a.kind != b.kind:
        out.append(f"the runs are of different kinds ({a.kind}, {b.kind})")
    if names_a != names_b:
        shared = len(names_a & names_b)
        out.append(f"the runs sampled different instances ({len(names_a - names_b)} only in #{a.id}, "
                   f"{len(names_b - names_a)} only in #{b.id}): the overall and the difference cover the "
                   f"{shared} shared instances only")
    return out


def compare_runs(s: Session, a_id: int, b_id: int) -> dict | None:
    """pass@1 and pass@k per instance and overall for two runs, the paired difference of pass@1
    with its bootstrap interval, and the warnings of `compare_warnings`.  None if a run is missing.

    k is the smaller run's group size, so both columns estimate the same quantity.  When the
    instance sets differ the overall covers the shared instances only.  `difference` is
    `app.stats.Comparison.to_dict()`, or None when the runs share no graded instance.
    """
    a, b = s.get(Run, a_id), s.get(Run, b_id)
    if a is None or b is None:
        return None
    k = min(_group_size(a), _group_size(b))
    results = [heldout.samples(s, a.id), heldout.samples(s, b.id)]
    names = sorted(set(results[0]) | set(results[1]))
    rows = [{"instance": name, "cells": [_cell(res[name], k) if name in res else None for res in results],
             "shared": all(name in res for res in results)} for name in names]
    shared = set(results[0]) & set(results[1])
    overall = [_overall({n: f for n, f in res.items() if n in shared}, k) for res in results]
    difference = compare_samples(*results, replicates=REPLICATES, seed=0).to_dict() if shared else None
    return {"runs": [a, b], "k": k, "rows": rows, "overall": overall, "difference": difference,
            "shared_only": set(results[0]) != set(results[1]),
            "warnings": compare_warnings(a, b, set(results[0]), set(results[1]))}
