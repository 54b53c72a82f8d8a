"""The train / held-out split of a task set whose records carry a `split` field (the starter set)."""
from __future__ import annotations

from typing import Sequence


def split_ids(records: list[dict], split: str) -> list[str]:
    """Instance ids of one split ("train" | "heldout") of raw records, in file order."""
    return [r["instance_id"] for r in records if r.get("split") == split]


def instance_ids(spec: str | Sequence[str]) -> list[str]:
    """Instance ids from a list of ids, or from "SET:SPLIT" such as "starter:train" (the records'
    `split` field); a list is returned as a new list, unchecked.

    Raises ValueError when "SET:SPLIT" names no instance, and what `load_task_set` raises for
    an unknown set.
    """
    if not isinstance(spec, str):
        return list(spec)
    from app.tasksets.loader import load_task_set

    name, _, split = spec.partition(":")
    ids = split_ids(load_task_set(name).raw, split)
    if not ids:
        raise ValueError(f"learn: {spec!r} names no instance (task set {name!r} has no split {split!r})")
    return ids
