"""Pydantic model of one SWE-bench-format task instance (`InstanceRecord`).

The layout is the one `swebench` 5.0.2 reads (`swebench/types.py`,
`harness/utils.py::make_test_spec`): every HF column is a string, and
`FAIL_TO_PASS` / `PASS_TO_PASS` are JSON-encoded lists *inside* strings.  Both
that form and plain lists are accepted; the model always holds lists.

Turnstile's extras (see data/tasks/PROVENANCE.md):
`source` (where the repository comes from: a PyPI sdist, a git repository at
`base_commit`, the SWE-bench default, or `inline` files written by a generator in the project), `bug_patch`, `install`, `test_cmd`,
`test_files`, `python`, `sdist_base_commit`.  Unknown fields are kept (`extra`)
so a record round-trips unchanged.

Rows of the published benchmarks (SWE-bench/Verified/Gym, SWE-smith, SWE-rebench V2,
R2E-Gym, Harbor task folders) are turned into this model by `app.tasksets.formats`; they
carry an `ImageSource` (the repository is inside the task's container image, at `repo_dir`)
and name their `grader`: `swebench` (an eval script and swebench's log parser, as for every
other record), `rebench` (SWE-rebench V2's apply flags, `test_cmd` and named parser),
`r2egym` (every parsed test status must equal `expected_statuses`) or `harbor`
(`tests/test.sh` writes the reward; `harbor` holds the task folder's parts).
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class PypiSdistSource(BaseModel):
    """The repository is the unpacked sdist `name==version` whose archive hashes to `sha256`."""

    model_config = ConfigDict(extra="allow")
    kind: Literal["pypi_sdist"]
    name: str = Field(min_length=1)
    version: str = Field(min_length=1)
    sha256: str
    filename: str | None = None

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        v = v.lower()
        if not _SHA256.match(v):
            raise ValueError("must be 64 lowercase hex digits (SHA-256 of the archive)")
        return v


class GitSource(BaseModel):
    """The repository is `url` (default `https://github.com/<repo>.git`) at the record's `base_commit`."""

    model_config = ConfigDict(extra="allow")
    kind: Literal["git"]
    url: str | None = None


class InlineSource(BaseModel):
    """The repository is `files` (relative POSIX path -> UTF-8 text), written by a generator in the project.

    For task families whose packages are generated rather than downloaded (the `starter` set,
    `python -m app.tasksets.starter`): built like an sdist (files written, `bug_patch` applied,
    one commit with the fixed sdist identity), so `sdist_base_commit` pins the tree.
    """

    model_config = ConfigDict(extra="allow")
    kind: Literal["inline"]
    name: str = Field(min_length=1)
    version: str = Field(min_length=1)
    files: dict[str, str] = Field(min_length=1)

    @field_validator("files")
    @classmethod
    def _relative(cls, v: dict[str, str]) -> dict[str, str]:
        for path in v:
            parts = path.split("/")
            if path.startswith("/") or ".." in parts or "" in parts or ".git" in parts:
                raise ValueError(f"file path {path[:200]!r} must be relative, inside the repository and not under .git")
        return v


class ImageSource(BaseModel):
    """The repository is inside the record's container `image`, at the record's `repo_dir`, already at its base commit.

    Nothing is built on the host: the image runtime pulls and unpacks the image.
    """

    model_config = ConfigDict(extra="allow")
    kind: Literal["image"]


class HarborSpec(BaseModel):
    """The parts of a Harbor task folder (https://harborframework.com/docs/tasks) a grade needs.

    `task_dir`: the folder (absolute host path); `tests_dir`: its `tests/` (copied to /tests
    for grading only, never shown to the agent); `oracle`: `solution/solve.sh` or None;
    `verifier_timeout_s` / `agent_timeout_s`: `[verifier]` / `[agent] timeout_sec` (seconds);
    `verifier_env`: `[verifier] env`; `network_mode`: `[verifier] network_mode`.
    """

    model_config = ConfigDict(extra="forbid")
    task_dir: str = Field(min_length=1)
    tests_dir: str = Field(min_length=1)
    oracle: str | None = None
    verifier_timeout_s: float = Field(600.0, gt=0)
    agent_timeout_s: float | None = Field(None, gt=0)
    verifier_env: dict[str, str] = Field(default_factory=dict)
    network_mode: str = "no-network"


Source = Annotated[Union[PypiSdistSource, GitSource, InlineSource, ImageSource], Field(discriminator="kind")]
Grader = Literal["swebench", "rebench", "r2egym", "harbor"]


def _json_list(value: Any) -> Any:
    """HF stores test lists as JSON text; decode it (lists pass through)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON-encoded list of test ids ({exc.msg})") from None
    return value


class InstanceRecord(BaseModel):
    """One task instance.  Raises `pydantic.ValidationError` on bad input (see `loader`)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    instance_id: str = Field(min_length=1)
    repo: str = Field(min_length=1)
    base_commit: str = ""
    patch: str = ""
    test_patch: str = ""
    problem_statement: str = Field(min_length=1)
    hints_text: str = ""
    created_at: str = ""
    version: str = ""
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]
    environment_setup_commit: str = ""
    image: str = ""
    eval_script: str = ""
    log_parser: str = "parse_log_pytest_v2"
    eval_type: Literal["pass_and_fail", "fail_only"] = "pass_and_fail"
    # --- Turnstile extras ---
    source: Source | None = None
    bug_patch: str = ""
    install: list[str] = Field(default_factory=list)
    test_cmd: str = ""
    test_files: list[str] = Field(default_factory=list)
    python: str = "3.11"
    difficulty: str | None = None
    sdist_base_commit: str | None = None
    # --- published benchmark rows (app.tasksets.formats) ---
    grader: Grader = "swebench"
    repo_dir: str = "/testbed"
    expected_statuses: dict[str, str] = Field(default_factory=dict)
    harbor: HarborSpec | None = None

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _decode_lists(cls, v: Any) -> Any:
        return _json_list(v)

    @field_validator("install", "test_files", mode="before")
    @classmethod
    def _decode_str_lists(cls, v: Any) -> Any:
        # Parquet/HF exports may carry these as JSON text too.
        if isinstance(v, str):
            return _json_list(v)
        return v

    @field_validator("source", mode="before")
    @classmethod
    def _decode_source(cls, v: Any) -> Any:
        if isinstance(v, str):
            if not v.strip():
                return None
            try:
                return json.loads(v)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON object ({exc.msg})") from None
        return v

    @field_validator("log_parser")
    @classmethod
    def _known_parser(cls, v: str) -> str:
        from app.tasksets.swebench_compat import parser_names

        if v not in parser_names():
            raise ValueError(f"unknown log parser {v!r} (not in swebench's PARSER_REGISTRY)")
        return v

    @field_validator("repo_dir")
    @classmethod
    def _absolute_dir(cls, v: str) -> str:
        parts = v.split("/")
        if not v.startswith("/") or ".." in parts or v == "/":
            raise ValueError(f"repo_dir {v[:200]!r} must be an absolute path below / without '..'")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _source_needs(self) -> "InstanceRecord":
        if self.source is None or self.source.kind == "git":
            if not re.fullmatch(r"[0-9a-f]{7,40}", self.base_commit or ""):
                raise ValueError("base_commit: a git source needs a commit id (7-40 hex digits)")
        if self.grader == "harbor":
            if self.harbor is None:
                raise ValueError("harbor: a harbor-graded record needs its task folder's parts")
            return self
        if not self.patch:
            raise ValueError("patch: the gold patch is required (it proves the instance can be solved)")
        if self.grader == "r2egym":
            if not self.expected_statuses:
                raise ValueError(f"expected_statuses: instance {self.instance_id!r} has no expected test status, "
                                 "so any run would match it")
            return self
        if not self.eval_script and not self.test_cmd:
            raise ValueError("eval_script: one of eval_script or test_cmd is required to grade")
        # Both eval types judge resolution on FAIL_TO_PASS (swebench 5.0.2 `get_eval_tests_report`):
        # with no id there, an empty patch resolves the instance.
        if not self.FAIL_TO_PASS:
            raise ValueError(f"FAIL_TO_PASS: instance {self.instance_id!r} has no FAIL_TO_PASS test, "
                             "so an empty patch would resolve it")
        from app.tasksets.swebench_compat import unmatchable_test_ids

        problems = unmatchable_test_ids(self)
        if problems:
            more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
            raise ValueError(f"{problems[0][0]}: instance {self.instance_id!r}: "
                             + "; ".join(message for _, message in problems[:3]) + more)
        return self

    @property
    def source_kind(self) -> str:
        return self.source.kind if self.source is not None else "git"

    def as_swebench(self) -> dict[str, Any]:
        """The record in HF string form (test lists JSON-encoded), extras included."""
        out = self.model_dump(mode="json")
        out["FAIL_TO_PASS"] = json.dumps(self.FAIL_TO_PASS)
        out["PASS_TO_PASS"] = json.dumps(self.PASS_TO_PASS)
        return out
