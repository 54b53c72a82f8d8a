"""What every published-format converter shares: the result shape, unknown-key reports, parser lookup.

A converter turns one published row into the dict `InstanceRecord` validates, or says why
it cannot (`Converted.error`: (field, message), reported at load with the row's line).
Keys a format does not define are kept on the record (the model keeps extras) and named
in `Converted.warnings`, never dropped silently.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable

# Keys Turnstile reads on a row of any published format (its own extensions).
TURNSTILE_KEYS = frozenset({"repo_dir", "test_cmd", "eval_script", "log_parser", "hidden_paths"})


@dataclasses.dataclass
class Converted:
    """One row after conversion: `row` for `InstanceRecord`, or `error` (field, message); `warnings` either way."""

    row: dict[str, Any] | None
    error: tuple[str, str] | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)


def unknown_keys(row: dict[str, Any], known: Iterable[str], fmt: str) -> list[str]:
    """One warning naming the keys of `row` that format `fmt` does not define ([] when none)."""
    extra = sorted(set(row) - set(known) - TURNSTILE_KEYS)
    if not extra:
        return []
    return [f"unknown key(s) for {fmt}: {', '.join(map(repr, extra))} (kept on the record, not used)"]


def json_value(value: Any) -> Any:
    """Decode a JSON-encoded string column (HF exports store lists and dicts as text); others pass through."""
    if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def swebench_parser_name(repo: str) -> str | None:
    """Name in swebench's `PARSER_REGISTRY` of the parser swebench 5.0.2 maps `repo` to
    (`harness/log_parsers/*::MAP_REPO_TO_PARSER_*`), or None for a repo it does not map."""
    from app.tasksets.swebench_compat import _register_harness_stub
    import importlib

    _register_harness_stub()
    parsers = importlib.import_module("swebench.harness.log_parsers")
    func = None
    for name in dir(parsers):
        table = getattr(parsers, name)
        if name.startswith("MAP_REPO_TO_PARSER") and isinstance(table, dict) and repo in table:
            func = table[repo]
    if func is None:
        py = importlib.import_module("swebench.harness.log_parsers.python")
        func = getattr(py, "MAP_REPO_TO_PARSER_PY", {}).get(repo)
    if func is None:
        return None
    names = [k for k, v in parsers.PARSER_REGISTRY.items() if v is func]
    short = repo.split("/")[-1].replace("-", "_").lower()
    return next((n for n in names if short in n), names[0] if names else None)


def fail_only(repo: str) -> bool:
    """True for repos swebench grades `fail_only` (`harness/constants::FAIL_ONLY_REPOS`)."""
    from app.tasksets.swebench_compat import constants_module

    return repo in getattr(constants_module(), "FAIL_ONLY_REPOS", set())
