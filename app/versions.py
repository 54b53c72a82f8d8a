"""Per-token policy versions, run-length encoded: `[[first token index, version], ...]`.

A completion sampled while an engine loaded new weights in weight update mode `keep` holds
tokens of several versions.  They are stored as runs: one
`[start, version]` pair where the version changes, starts strictly increasing from 0.  A
completion sampled by one version is one run `[[0, v]]`.  Torch-free: the gateway, the
trajectory builder, the exports and the dashboard all read them.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence


def encode(versions: Iterable[int | None]) -> list[list[int]]:
    """Runs of a per-token version list ([S] ints; a None token extends the run before it)."""
    runs: list[list[int]] = []
    for i, v in enumerate(versions):
        if v is not None and (not runs or runs[-1][1] != v):
            runs.append([i, int(v)])
    if runs:
        runs[0][0] = 0
    return runs


def valid(runs: Any, length: int) -> bool:
    """True when `runs` is a well-formed encoding for `length` tokens: a list of [int, int]
    pairs, the first starting at 0, starts strictly increasing and below `length`, versions ≥ 0."""
    if not isinstance(runs, list) or not runs or length <= 0:
        return False
    previous = -1
    for run in runs:
        if not (isinstance(run, (list, tuple)) and len(run) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in run)):
            return False
        start, version = run
        if start <= previous or start >= length or version < 0:
            return False
        previous = start
    return runs[0][0] == 0


def expand(runs: Sequence[Sequence[int]] | None, length: int, default: int | None) -> list[int | None]:
    """The per-token list ([length]) of `runs`; every token is `default` when `runs` is None or
    empty (a row recorded before per-token capture: its one `policy_version`)."""
    if not runs:
        return [default] * length
    out: list[int | None] = []
    for k, (start, version) in enumerate(runs):
        end = runs[k + 1][0] if k + 1 < len(runs) else length
        out.extend([int(version)] * max(0, min(end, length) - len(out)))
    return out[:length]


def oldest(runs: Sequence[Sequence[int]] | None, default: int | None) -> int | None:
    """The oldest version among `runs` (`default` when there are none)."""
    return min((int(v) for _, v in runs), default=default) if runs else default


def from_arrivals(arrivals: Sequence[tuple[int, float]], length: int,
                  updates: Sequence[tuple[int, float]], default: int) -> list[list[int]]:
    """Runs for an engine that stamps no versions (vLLM), from when each chunk arrived.

    `arrivals`: `(index of the chunk's first token, wall-clock seconds it arrived)` in order;
    `updates`: `(version loaded, split time)` of the engine's weight updates, where the split time
    lies inside the pause (no token is produced while an engine is paused, so every token that
    arrives before it was sampled by the weights before, every one after by the weights after;
    the middle of the pause tolerates clock skew between hosts up to half its length).  A chunk
    takes the version of the latest update split before it arrived, `default` when none was.
    """
    ordered = sorted(updates, key=lambda u: u[1])
    per_token: list[int] = []
    for k, (start, t) in enumerate(arrivals):
        end = arrivals[k + 1][0] if k + 1 < len(arrivals) else length
        version = default
        for v, split in ordered:
            if split <= t:
                version = v
            else:
                break
        per_token.extend([version] * max(0, end - start))
    return encode(per_token[:length])
