"""An eval run's per-instance results and the comparison of two runs, read from SQL (statistics from `app.stats`).

pass@1 of an instance is the resolved fraction of its completed samples, with a 95% Wilson
interval; pass@k is Chen et al.'s unbiased estimate.  The paired difference of two runs is
the clustered bootstrap `app.stats.compare_samples` (the one `turnstile compare` prints),
over the instances both runs sampled.  Two runs whose numbers do not measure the same thing
(`comparability`) are refused unless the caller forces it, and are then compared with a warning
per mismatch.
"""
from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.api.errors import parse_flag
from app.control import heldout
from app.stats import compare_samples, pass_at_k, wilson
from app.tables import Episode, Run, TaskInstance

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


def force_flag(raw: str | None) -> bool:
    """`force` of a query string (`app.api.errors.parse_flag`); ValueError otherwise."""
    return parse_flag("force", raw)


class NotComparable(ValueError):
    """Two runs whose numbers cannot be compared; `reasons` holds one sentence per mismatch."""

    def __init__(self, a_id: int, b_id: int, reasons: list[str]):
        super().__init__(f"runs #{a_id} and #{b_id} cannot be compared: " + "; ".join(reasons))
        self.reasons = reasons


def trained_by(config: dict | None) -> int | None:
    """The train run whose policy an eval samples: `model.checkpoint: run:<id>` (an eval of a
    trained checkpoint, the last held-out eval) or `eval_of.run` (a mid-run held-out eval); None
    for an eval of a base model or of a folder."""
    cfg = config or {}
    spec = str((cfg.get("model") or {}).get("checkpoint") or "")
    tail = spec.removeprefix("run:")
    if spec.startswith("run:") and tail.isdigit():
        return int(tail)
    parent = (cfg.get("eval_of") or {}).get("run")
    return int(parent) if parent is not None else None


def instance_set(s: Session, run: Run) -> set[str]:
    """The instances `run` was asked to sample: its config's `instances`, or, for a run over its
    whole task set, the instances of its episodes (any status)."""
    listed = (run.config or {}).get("instances")
    if listed:
        return set(listed)
    return set(s.scalars(select(TaskInstance.instance_id).join(Episode, Episode.instance_id == TaskInstance.id)
                         .where(Episode.run_id == run.id).distinct()))


def _short(names: set[str], n: int = 3) -> str:
    listed = ", ".join(sorted(names)[:n])
    return listed + (f" and {len(names) - n} more" if len(names) > n else "")


def comparability(s: Session, a: Run, b: Run) -> tuple[list[str], bool]:
    """(mismatches, held_out) of comparing eval `a` (before) with eval `b` (after).

    A mismatch is one sentence naming a run: a run that is not a completed eval (its numbers are
    partial, none at all for a run that never started, or from a policy that changed while a
    train run sampled them); task sets or instance sets that differ (one run's set containing the
    other's is comparable: the paired difference covers the smaller set whole); an eval that
    samples a train run's policy on instances that train run trained on.  `held_out` is True
    only when some eval samples a train run's policy and every such eval's instances are disjoint
    from the ones its train run saw (its episodes' instances and its config's `instances`).
    The CLI (`turnstile compare`), the API (`GET /api/compare`) and the compare page all ask here.
    """
    out = []
    for r in (a, b):
        if r.kind != "eval":
            out.append(f"run #{r.id} is a {r.kind} run, not an eval: its samples came from a policy "
                       f"that changed while it ran")
        if r.status == "queued":
            out.append(f"run #{r.id} is queued: it never started, it has no results")
        elif r.status != "completed":
            out.append(f"run #{r.id} is {r.status}: its results are partial")
    tasks = [(r.config or {}).get("task_set") for r in (a, b)]
    if tasks[0] != tasks[1]:
        out.append(f"the runs sample different task sets ({tasks[0]!r} in #{a.id}, {tasks[1]!r} in #{b.id})")
    names = {r.id: instance_set(s, r) for r in (a, b)}
    na, nb = names[a.id], names[b.id]
    if not (na <= nb or nb <= na):
        out.append(f"the runs sample different instances ({len(na - nb)} only in #{a.id}: {_short(na - nb)}; "
                   f"{len(nb - na)} only in #{b.id}: {_short(nb - na)})")
    held_out = None
    for r in (a, b):
        parent = s.get(Run, p) if (p := trained_by(r.config)) is not None else None
        if parent is None or parent.kind != "train":
            continue
        seen = set((parent.config or {}).get("instances") or []) | instance_set(s, parent)
        overlap = names[r.id] & seen
        if overlap:
            out.append(f"run #{r.id} evaluates train run #{parent.id}'s policy on {len(overlap)} instance(s) it "
                       f"trained on ({_short(overlap)}): not held-out")
        held_out = not overlap and held_out is not False
    # a pair with any mismatch makes no held-out claim, forced or not: a train run is no "before"
    return out, bool(held_out) and not out


def sampled_warnings(a: Run, b: Run, names_a: set[str], names_b: set[str]) -> list[str]:
    """What a comparable pair still leaves out: instances graded by one run only."""
    if names_a == names_b:
        return []
    return [f"the runs have graded results for different instances ({len(names_a - names_b)} only in #{a.id}, "
            f"{len(names_b - names_a)} only in #{b.id}): the overall and the difference cover the "
            f"{len(names_a & names_b)} shared instances only"]


def compare_runs(s: Session, a_id: int, b_id: int, force: bool = False) -> dict | None:
    """pass@1 and pass@k per instance and overall for two eval runs, the paired difference of pass@1
    with its bootstrap interval, whether the after run is `held_out`, and `warnings`.  None if a
    run is missing.

    Raises NotComparable with the mismatches of `comparability` unless `force`; forced, each
    mismatch is a warning.  k is the smaller run's group size, so both columns estimate the same
    quantity.  The overall covers the instances both runs graded.  `difference` is
    `app.stats.Comparison.to_dict()`, or None when the runs share no graded instance.
    """
    a, b = s.get(Run, a_id), s.get(Run, b_id)
    if a is None or b is None:
        return None
    mismatches, held_out = comparability(s, a, b)
    if mismatches and not force:
        raise NotComparable(a.id, b.id, mismatches)
    k = min(_group_size(a), _group_size(b))
    results = [heldout.samples(s, a.id), heldout.samples(s, b.id)]
    names = sorted(set(results[0]) | set(results[1]))
    rows = [{"instance": name, "cells": [_cell(res[name], k) if name in res else None for res in results],
             "shared": all(name in res for res in results)} for name in names]
    shared = set(results[0]) & set(results[1])
    overall = [_overall({n: f for n, f in res.items() if n in shared}, k) for res in results]
    difference = compare_samples(*results, replicates=REPLICATES, seed=0).to_dict() if shared else None
    return {"runs": [a, b], "k": k, "rows": rows, "overall": overall, "difference": difference,
            "shared_only": set(results[0]) != set(results[1]), "held_out": held_out, "forced": bool(mismatches),
            "warnings": mismatches + sampled_warnings(a, b, set(results[0]), set(results[1]))}
