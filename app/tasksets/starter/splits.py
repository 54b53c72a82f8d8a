"""Named splits of a task set whose records carry a `split` field (the starter and family sets).

A split spec is "SET:SPLIT" (the records' `split` field, e.g. "starter:heldout") or
"SET:SPLIT@SEED" (the records' `splits[SEED]`, for sets split under several seeds, e.g.
"family:train@1").  `split_problem` says what is wrong with a spec without raising, for run
validation; `instance_ids` resolves one.
"""
from __future__ import annotations

from typing import Sequence


def split_ids(records: list[dict], split: str, seed: str | None = None) -> list[str]:
    """Instance ids of one split of raw records, in file order: the `split` field, or `splits[seed]`."""
    if seed is None:
        return [r["instance_id"] for r in records if r.get("split") == split]
    return [r["instance_id"] for r in records if (r.get("splits") or {}).get(seed) == split]


def parse_spec(spec: str) -> tuple[str, str, str | None]:
    """("SET", "SPLIT", "SEED" or None) of a split spec; raises ValueError when it has no ":"."""
    name, colon, rest = spec.partition(":")
    if not colon or not name or not rest:
        raise ValueError(f"{spec!r} is not a split spec: write SET:SPLIT or SET:SPLIT@SEED, e.g. 'family:heldout'")
    split, at, seed = rest.partition("@")
    return name, split, (seed if at else None)


def spec_ids(records: list[dict], spec: str) -> list[str]:
    """Instance ids that the split spec `spec` names in `records` (the set's raw records).

    Raises ValueError naming the seeds or splits that exist when the spec names none.
    """
    name, split, seed = parse_spec(spec)
    if seed is not None:
        seeds = sorted({s for r in records for s in (r.get("splits") or {})}, key=lambda s: (len(s), s))
        if seed not in seeds:
            have = f"split seeds {', '.join(seeds)}" if seeds else "no split seeds"
            raise ValueError(f"{spec!r}: task set {name!r} has {have}, not {seed!r}")
        known = sorted({(r.get("splits") or {}).get(seed) for r in records} - {None})
    else:
        known = sorted({r.get("split") for r in records} - {None})
    ids = split_ids(records, split, seed)
    if not ids:
        have = f"splits {', '.join(known)}" if known else "no split field"
        raise ValueError(f"{spec!r} names no instance: task set {name!r} has {have}, not {split!r}")
    return ids


def instance_ids(spec: str | Sequence[str]) -> list[str]:
    """Instance ids from a list of ids, or from a split spec such as "starter:train" or
    "family:heldout@1"; a list is returned as a new list, unchecked.

    Raises ValueError when the spec names no instance (unknown split or seed), and what
    `load_task_set` raises for an unknown set.
    """
    if not isinstance(spec, str):
        return list(spec)
    from app.tasksets.loader import load_task_set

    name, _, _ = parse_spec(spec)
    try:
        return spec_ids(load_task_set(name).raw, spec)
    except ValueError as exc:
        raise ValueError(f"learn: {exc}") from None
