"""Load task sets: SWE-bench JSONL, HF datasets JSON / parquet, by name or path.

Named sets:
  * `synthetic` (default): `data/tasks/synthetic.jsonl`, bundled (PROVENANCE.md there).
  * `starter`: `data/tasks/starter.jsonl`, bundled, written by `python -m app.tasksets.starter`
    (one-line bugs in small generated packages, easy enough for SmolLM2 to solve some).
  * `family`: `data/tasks/family.jsonl`, bundled, written by `python -m app.tasksets.family`
    (160 one-line bugs of eight kinds in fourteen generated packages, split train / held-out at
    random and an out-of-family split of kinds absent from train).
  * `layouts`: `data/tasks/layouts.jsonl`, bundled, written by `python -m app.cli.layouts_build`
    (bugs in library code at test-looking paths of six real sdists: click, flask, werkzeug,
    tornado, pint, Jinja2).
  * `swebench-real`: `../shared/tasks/swebench-real.jsonl` relative to the repository
    root; never copied into the project, so it exists only where that folder does.
  * anything else is a path: a `.jsonl`/`.json`/`.parquet` file, or a folder in the HF
    datasets layout (`*.parquet` / `*.jsonl` / `*.json` files, e.g. `data/test-00000-of-00001.parquet`),
    inside the bundled `data/tasks`, `<TURNSTILE_VAR_DIR>/tasks` or a folder listed in
    `TURNSTILE_TASK_DIRS` (a run's config must not make the server read arbitrary host files),
    of at most `TURNSTILE_TASK_SET_MAX_BYTES` in regular files and `TURNSTILE_TASK_SET_MAX_RECORDS`
    records.

Published formats are read as published (`app.tasksets.formats`): SWE-bench / Verified /
SWE-Gym, SWE-smith, SWE-rebench V2 and R2E-Gym rows in any of those files, and Harbor task
folders (a folder holding `task.toml`, or a folder of such folders).  Each file's format is
told from its first row; keys a format does not define are listed in `TaskSet.warnings`.

Validation reports *every* bad record, each with its line (JSONL line number, JSON
array index + 1, or parquet row + 1, a Harbor task's folder), `instance_id` when readable,
and field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from pydantic import ValidationError

from app.config import ROOT, get_settings
from app.tasksets import formats
from app.tasksets.schema import InstanceRecord

DEFAULT_TASK_SET = "synthetic"
BUNDLED_DIR = ROOT / "data" / "tasks"
SHARED_TASKS_DIR = ROOT.parent / "shared" / "tasks"
NAMED_SETS = {
    "synthetic": BUNDLED_DIR / "synthetic.jsonl",
    "starter": BUNDLED_DIR / "starter.jsonl",
    "family": BUNDLED_DIR / "family.jsonl",
    "layouts": BUNDLED_DIR / "layouts.jsonl",
    "swebench-real": SHARED_TASKS_DIR / "swebench-real.jsonl",
}


@dataclass(frozen=True)
class RecordError:
    """One problem with one record: where (`source`, `line`), which record, which field, what."""

    source: str
    line: int
    field: str
    message: str
    instance_id: str | None = None

    def __str__(self) -> str:
        who = f" (instance_id={self.instance_id!r})" if self.instance_id else ""
        return f"{self.source} line {self.line}{who}: field {self.field!r}: {self.message}"


class TaskSetError(ValueError):
    """A task set could not be loaded; `.errors` lists every bad record (`RecordError`)."""

    def __init__(self, message: str, errors: list[RecordError] | None = None):
        self.errors = list(errors or [])
        detail = "".join(f"\n  {e}" for e in self.errors[:50])
        more = f"\n  ... and {len(self.errors) - 50} more" if len(self.errors) > 50 else ""
        super().__init__(message + detail + more)


class TaskSetNotFound(TaskSetError, FileNotFoundError):
    """The named task set or path does not exist here."""


@dataclass
class TaskSet:
    """A loaded task set: `name` (as stored in `task_instances.task_set`), its file(s), instances in file order."""

    name: str
    path: Path
    instances: list[InstanceRecord]
    raw: list[dict[str, Any]] = field(default_factory=list, repr=False)  # records as given, same order
    warnings: list[str] = field(default_factory=list)  # unknown keys of published rows, one line each
    formats: dict[str, int] = field(default_factory=dict)  # {format: records} (app.tasksets.formats)

    def by_id(self) -> dict[str, InstanceRecord]:
        return {r.instance_id: r for r in self.instances}

    def get(self, instance_id: str) -> InstanceRecord:
        for rec in self.instances:
            if rec.instance_id == instance_id:
                return rec
        raise KeyError(f"task set {self.name!r} has no instance {instance_id!r}")


def resolve_task_set(name_or_path: str | Path = DEFAULT_TASK_SET) -> tuple[str, Path]:
    """(name, path) for a named set or a path; raises `TaskSetNotFound` with the reason."""
    key = str(name_or_path)
    if key in NAMED_SETS:
        path = NAMED_SETS[key]
        if not path.exists():
            raise TaskSetNotFound(f"task set {key!r} is not available here: {path} does not exist")
        return key, path
    allowed = allowed_task_dirs()
    path = Path(key).expanduser().resolve()
    if not any(path == d or d in path.parents for d in allowed):
        raise TaskSetNotFound(f"task set {key[:200]!r} is neither a named set ({', '.join(NAMED_SETS)}) nor a path "
                              f"inside an allowed folder ({', '.join(map(str, allowed))}; add one with "
                              "TURNSTILE_TASK_DIRS)")
    if not path.exists():
        raise TaskSetNotFound(f"task set {key[:200]!r} does not exist")
    _check_size(path)
    return str(path), path


def allowed_task_dirs() -> list[Path]:
    """Folders a task set path may point into: bundled sets, `<var_dir>/tasks`, `TURNSTILE_TASK_DIRS`."""
    settings = get_settings()
    return [BUNDLED_DIR.resolve(), (settings.var_dir / "tasks").resolve(), *settings.task_dirs]


def _task_files(path: Path) -> list[Path]:
    """The files a task set path stands for: itself, or a folder's `.jsonl`/`.json`/`.parquet` files.

    Raises TaskSetError for anything but a regular file or a folder (devices, pipes).
    """
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.suffix in {".jsonl", ".json", ".parquet"} and p.is_file())
    if not path.is_file():
        raise TaskSetError(f"{path}: a task set must be a regular file or a folder")
    return [path]


def _check_size(path: Path) -> None:
    limit = get_settings().task_set_max_bytes
    total = sum(f.stat().st_size for f in _task_files(path))
    if total > limit:
        raise TaskSetError(f"{path}: {total} bytes of task files, above the limit of {limit} "
                           "(TURNSTILE_TASK_SET_MAX_BYTES)")


def _rows_jsonl(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line), None
            except json.JSONDecodeError as exc:
                yield lineno, None, f"invalid JSON: {exc.msg}: column {exc.colno}"


def _rows_json(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        # HF "json" exports are often JSON Lines with a .json suffix.
        yield from _rows_jsonl(path)
        return
    if isinstance(data, dict):  # {"rows": [...]} / {"data": [...]} or a single record
        data = data.get("rows") or data.get("data") or data.get("instances") or [data]
    for i, row in enumerate(data, 1):
        yield i, row.get("row", row) if isinstance(row, dict) else row, None


def _rows_parquet(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow is installed here
        raise TaskSetError(f"{path}: reading parquet needs pyarrow ({exc})") from None
    for i, row in enumerate(pq.read_table(path).to_pylist(), 1):
        yield i, row, None


def _rows(path: Path) -> Iterator[tuple[str, int, Any, str | None]]:
    files = _task_files(path)
    if not files:
        raise TaskSetError(f"{path}: folder holds no .jsonl, .json or .parquet files")
    limit, count = get_settings().task_set_max_records, 0
    for f in files:
        reader = {".parquet": _rows_parquet, ".json": _rows_json}.get(f.suffix, _rows_jsonl)
        for line, row, err in reader(f):
            count += 1
            if count > limit:
                raise TaskSetError(f"{path}: more than {limit} records (TURNSTILE_TASK_SET_MAX_RECORDS)")
            yield f.name, line, row, err


def _errors_of(exc: ValidationError, source: str, line: int, iid: str | None) -> list[RecordError]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if not loc and ":" in msg:  # model-level checks name their field first ("base_commit: ...")
            loc, msg = (s.strip() for s in msg.split(":", 1))
        out.append(RecordError(source, line, loc or "<record>", msg, iid))
    return out


def validate_records(rows: list[tuple[str, int, Any, str | None]]) -> tuple[list[InstanceRecord], list[dict], list[RecordError]]:
    """Validate (source, line, row, parse_error) tuples; returns (records, raw rows, errors)."""
    records, raws, errors, seen = [], [], [], {}
    for source, line, row, parse_error in rows:
        if parse_error:
            errors.append(RecordError(source, line, "<line>", parse_error))
            continue
        if not isinstance(row, dict):
            errors.append(RecordError(source, line, "<record>", f"expected a JSON object, got {type(row).__name__}"))
            continue
        iid = row.get("instance_id") if isinstance(row.get("instance_id"), str) else None
        try:
            rec = InstanceRecord.model_validate(row)
        except ValidationError as exc:
            errors.extend(_errors_of(exc, source, line, iid))
            continue
        if rec.instance_id in seen:
            errors.append(RecordError(source, line, "instance_id", f"duplicate of line {seen[rec.instance_id]}", iid))
            continue
        seen[rec.instance_id] = line
        records.append(rec)
        raws.append(row)
    return records, raws, errors


def _converted_rows(path: Path) -> tuple[list[tuple[str, int, Any, str | None]], list[RecordError], list[str],
                                          dict[str, int]]:
    """Rows of `path` in `InstanceRecord` form: (rows, conversion errors, warnings, {format: rows})."""
    out, errors, warnings, counts = [], [], [], {}

    def take(source: str, line: int, fmt: str, conv: formats.Converted, iid: Any) -> None:
        iid = iid if isinstance(iid, str) else None
        who = f" (instance_id={iid!r})" if iid else ""
        warnings.extend(f"{source} line {line}{who}: {w}" for w in conv.warnings)
        if conv.error:
            errors.append(RecordError(source, line, conv.error[0], conv.error[1], iid))
        else:
            counts[fmt] = counts.get(fmt, 0) + 1
            out.append((source, line, conv.row, None))

    tasks = formats.harbor.task_dirs(path) if path.is_dir() else []
    if tasks:
        for i, task in enumerate(tasks, 1):
            take(task.name, i, "harbor", formats.harbor.convert_task(task), task.name)
        return out, errors, warnings, counts
    by_file: dict[str, list[tuple[str, int, Any, str | None]]] = {}
    for row in _rows(path):
        by_file.setdefault(row[0], []).append(row)
    for source, rows in by_file.items():
        first = next((r for _, _, r, err in rows if err is None and isinstance(r, dict)), None)
        fmt = formats.detect_format(first, str(path))
        good = [(line, row) for _, line, row, err in rows if err is None and isinstance(row, dict)]
        converted = iter(formats.convert(fmt, [row for _, row in good]))
        for _, line, row, err in rows:
            if err is not None or not isinstance(row, dict):
                out.append((source, line, row, err))  # reported by validate_records, as before
            else:
                take(source, line, fmt, next(converted), row.get("instance_id"))
    return out, errors, warnings, counts


def load_published(path: str | Path) -> tuple[list[InstanceRecord], list[dict[str, Any]], list[str], dict[str, int]]:
    """Read, convert (`app.tasksets.formats`) and validate every record of a file or folder.

    Returns (records, record dicts as validated, warnings, {format: records}).  Raises
    `TaskSetNotFound` or `TaskSetError` listing every bad record (a conversion's reason included).
    """
    path = Path(path)
    if not path.exists():
        raise TaskSetNotFound(f"{path} does not exist")
    rows, conv_errors, warnings, counts = _converted_rows(path)
    records, raws, errors = validate_records(rows)
    errors = sorted(conv_errors + errors, key=lambda e: (e.source, e.line))
    if errors:
        raise TaskSetError(f"{path}: {len(errors)} problem(s) in the task set", errors)
    if not records:
        raise TaskSetError(f"{path}: no task instances")
    return records, raws, warnings, counts


def load_records(path: str | Path) -> tuple[list[InstanceRecord], list[dict[str, Any]]]:
    """Read and validate every record of a file or folder.  Raises `TaskSetError` listing all bad records."""
    records, raws, _warnings, _counts = load_published(path)
    return records, raws


def load_task_set(name_or_path: str | Path = DEFAULT_TASK_SET) -> TaskSet:
    """Load a named task set (`synthetic`, `swebench-real`) or a path.

    Raises `TaskSetNotFound` (missing) or `TaskSetError` (bad records; `.errors` has each).
    """
    name, path = resolve_task_set(name_or_path)
    records, raws, warnings, counts = load_published(path)
    return TaskSet(name=name, path=path, instances=records, raw=raws, warnings=warnings, formats=counts)
