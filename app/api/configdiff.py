"""The config diff of two runs: their stored configs flattened to dotted keys, only the keys that differ.

A nested mapping becomes one key per leaf (`training.learning_rate`); a list is one value, compared
whole (an instance list that differs in one id is one changed key, not a key per position).  The
stored configs are `RunConfig` dumps with every default filled in, so a key is "added" or "removed"
only where a section is present in one run and null or absent in the other (`simulate`, `eval_of`).
"""
from __future__ import annotations

from typing import Any

MISSING = object()


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}, "c": [1]}` -> `{"a.b": 1, "c": [1]}`; an empty mapping is kept as `{}` under its key."""
    if not isinstance(config, dict) or (not config and prefix):
        return {prefix: config}
    out: dict[str, Any] = {}
    for key, value in config.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_diff(a: dict | None, b: dict | None) -> list[dict]:
    """The differing keys of configs `a` and `b`, sorted by key: `[{"key", "change", "a", "b"}]` with
    `change` one of "added" (only in b; `a` is None), "removed" (only in a; `b` is None), "changed"."""
    fa, fb = flatten(a or {}), flatten(b or {})
    rows = []
    for key in sorted(set(fa) | set(fb)):
        va, vb = fa.get(key, MISSING), fb.get(key, MISSING)
        if va is MISSING:
            rows.append({"key": key, "change": "added", "a": None, "b": vb})
        elif vb is MISSING:
            rows.append({"key": key, "change": "removed", "a": va, "b": None})
        elif va != vb or type(va) is not type(vb):
            rows.append({"key": key, "change": "changed", "a": va, "b": vb})
    return rows
