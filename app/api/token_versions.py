"""Per-token policy versions of a completion and of a trained sequence, decoded from the runs
stored with them (`app.versions`), for the export and the dashboard's token view.

A completion stores `policy_versions` (runs over its sampled tokens; None on rows older than
per-token capture, whose one `policy_version` then covers every token) and `kv_versions` (runs,
None when the KV each token attended to is as new as the weights that sampled it).  A trajectory
stores per span (`meta.spans`, one per merged completion) that completion's `policy_version`
(`meta.policy_versions`) and, for a span that crosses an in-flight weight update, its runs
(`meta.version_runs`); its KV versions are the merged completions' own `kv_versions`.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from app import versions
from app.tables import Completion, Trajectory

PerToken = list[int | None]


def completion_versions(c: Completion) -> tuple[PerToken, PerToken | None]:
    """(policy version of each sampled token [S], KV version of each [S] or None when no token's
    KV was older than its weights).  A token is None only when the row has no version at all."""
    n = len(c.sampled_ids or [])
    policy = versions.expand(c.policy_versions, n, c.policy_version)
    kv = versions.expand(c.kv_versions, n, None) if c.kv_versions else None
    return policy, kv


def trajectory_versions(t: Trajectory, kv_runs: Mapping[Any, Sequence[Sequence[int]] | None]
                        ) -> tuple[PerToken, PerToken | None]:
    """(policy version of each position [T], KV version of each [T] or None when no merged
    completion recorded `kv_versions`).  Context positions (loss mask 0) are None.

    `kv_runs`: the `kv_versions` of the completions merged into `t`, by the ids its
    `completion_ids` lists (a completion absent from it has KV as new as its weights)."""
    meta = t.meta or {}
    n = len(t.token_ids)
    policy: PerToken = [None] * n
    kv: PerToken = [None] * n
    recorded = False
    spans = meta.get("spans") or []
    runs = meta.get("version_runs") or []
    defaults = meta.get("policy_versions") or []
    ids = list(t.completion_ids or [])
    for k, (start, end) in enumerate(spans):
        start, end = max(0, int(start)), min(n, int(end))
        if end <= start:
            continue
        span = versions.expand(runs[k] if k < len(runs) else None, end - start,
                               defaults[k] if k < len(defaults) else None)
        policy[start:end] = span
        stale = kv_runs.get(ids[k]) if k < len(ids) else None
        recorded = recorded or bool(stale)
        kv[start:end] = versions.expand(stale, end - start, None) if stale else span
    return policy, (kv if recorded else None)


def lag_class(version: int | None, reference: int | None) -> str:
    """The token view's class of a token of `version` trained against `reference`: `lag-0`,
    `lag-1`, `lag-2` (two or more versions behind) or `lag-unknown` (either side unknown)."""
    if version is None or reference is None:
        return "lag-unknown"
    return f"lag-{min(2, max(0, reference - version))}"
