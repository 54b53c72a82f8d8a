"""Where each setting of a run came from: the file, `--set`, the API body, the warm start, or a default.

A run's stored config holds every field (defaults filled in), so without a record the run page
cannot tell a value the user chose from one nobody chose.  Provenance is a flat map
`{dotted path: source}` over the leaves of the stored config (a list is one leaf), written at
run creation next to the config (`runs.provenance`).

The API knows only its body: every leaf the body holds is `api`, every other one `default`.  A
client that assembled the body from several sources (the CLI: a file, then `--set`, then the
warm start) says so in the `Turnstile-Provenance` request header, a JSON object of the same shape;
the API accepts a claim only for a path the body holds and only with a client-side source
(`CLIENT_SOURCES`), so a header cannot make a default look chosen or a chosen value look default.

The rule of conflicts (`checkpoint_conflict`): one setting set by the user twice through
different routes is never resolved in silence.  `--set model.checkpoint` beats a `warm_start`
section of the file (the command line overrides the file, as for every field) and the warm start
is skipped, which the CLI says; a checkpoint and a warm start from the same source are refused.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

FILE, SET, API, WARM_START, DEFAULT = "file", "--set", "api", "warm start", "default"
SOURCES = (FILE, SET, API, WARM_START, DEFAULT)
CLIENT_SOURCES = (FILE, SET, WARM_START)  # what a client may claim for a path its body holds
HEADER = "Turnstile-Provenance"
MAX_HEADER_CHARS = 64_000  # a claim longer than this is ignored (the body's paths are a few hundred)


def leaves(config: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of the leaves of a nested dict (`{"model": {"name": 1}}` -> `["model.name"]`);
    a list or a scalar is a leaf, an empty dict has none."""
    out: list[str] = []
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.extend(leaves(value, path + "."))
        else:
            out.append(path)
    return out


def mark(origins: dict[str, str], config: Mapping[str, Any], source: str, prefix: str = "") -> None:
    """Set `source` on every leaf of `config` (under `prefix`) in `origins`, in place."""
    for path in leaves(config, prefix):
        origins[path] = source


def parse_claim(raw: str | None) -> dict[str, str]:
    """The client's `{path: source}` claim from the header value; {} when absent, malformed or too long
    (a claim only labels values, so a bad one falls back to `api` rather than refusing the run)."""
    if not raw or len(raw) > MAX_HEADER_CHARS:
        return {}
    try:
        claim = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(claim, dict):
        return {}
    return {str(k): v for k, v in claim.items() if isinstance(v, str) and v in CLIENT_SOURCES}


def record(stored: Mapping[str, Any], body: Mapping[str, Any], claim: Mapping[str, str] | None = None) -> dict[str, str]:
    """`{path: source}` for every leaf of `stored` (the validated config with defaults).

    A leaf the request `body` holds is `claim[path]` when the client claimed a client source for it,
    else `api`; a leaf the body lacks is `default`.
    """
    given = set(leaves(body))
    claim = claim or {}
    return {path: (claim.get(path, API) if path in given else DEFAULT) for path in leaves(stored)}


def checkpoint_conflict(origins: Mapping[str, str], warm_source: str | None) -> str | None:
    """What to do when a `warm_start` section (from `warm_source`) meets a user-set `model.checkpoint`.

    Returns None when there is no conflict (no warm start, or no checkpoint set), `"skip"` when the
    checkpoint came from `--set` and the warm start from the file (the command line wins: the warm
    start is skipped), and raises ValueError naming both when they came from the same source.
    """
    chosen = origins.get("model.checkpoint")
    if warm_source is None or chosen is None:
        return None
    if chosen == SET and warm_source == FILE:
        return "skip"
    raise ValueError(f"model.checkpoint (from {chosen}) and a warm_start section (from {warm_source}) both choose "
                     "the weights the run starts from; remove one of them (a --set model.checkpoint overrides a "
                     "warm_start section of the file)")


def chosen_rows(config: Mapping[str, Any], origins: Mapping[str, str] | None) -> dict | None:
    """What the run page shows: `{"rows": [{"path", "value", "source"}], "defaults": n}`, one row per
    setting someone chose (every source but `default`, in path order; `value` as compact JSON), and
    how many settings kept their default; None for a run created before sources were recorded."""
    if origins is None:
        return None
    values: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.")
            else:
                values[f"{prefix}{key}"] = value

    walk(config, "")
    rows = [{"path": path, "value": json.dumps(values.get(path), separators=(", ", ": ")), "source": source}
            for path, source in sorted(origins.items()) if source != DEFAULT]
    return {"rows": rows, "defaults": sum(1 for s in origins.values() if s == DEFAULT)}
