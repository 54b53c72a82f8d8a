"""SWE-smith rows: a healthy repository in a per-repo image, plus the `patch` that *creates* the bug.

Row (HF `SWE-bench/SWE-smith*` dataset cards): `instance_id, patch, FAIL_TO_PASS,
PASS_TO_PASS, image_name, repo, problem_statement` (test lists as lists), sometimes
`created_at` and `base_commit`.  `repo` is the per-repo mirror, e.g.
`swesmith/<owner>__<name>.<commit8>`; `image_name` holds that repository at /testbed with
conda's `testbed` env.

The task is rebuilt offline as the image's repository with `patch` applied (`bug_patch`,
committed at prepare so the agent's diff starts from the bug); the gold fix is the reverse of
`patch`.  SWE-smith's own harness instead checks out a per-instance branch fetched from the
mirror (`swesmith/harness/utils.py::run_patch_in_container`), which needs the network.

Tests: SWE-smith's default Python profile (`swesmith/profiles/python.py::PythonProfile`):
`pytest --disable-warnings --color=no --tb=no --verbose` in the `testbed` env, on the files of
FAIL_TO_PASS (`swesmith/harness/utils.py::get_test_command`).  Its `--verbose` lines end in a
progress figure (`path::test PASSED [ 5%]`), which swebench's parsers do not read, so the eval
script exports `PYTEST_ADDOPTS=-rA`: pytest adds its `PASSED path::test` summary, which
`parse_log_pytest_v2` reads, and runs the same tests.  A row may carry its own `test_cmd`
(a profile that overrides it), run as it is.

The row's `base_commit` is SWE-smith's bug commit on its mirror's branch (`harness/gather.py`),
which is not in the image; the runtime makes its own bug commit from `patch`.
"""
from __future__ import annotations

from typing import Any, Sequence

import unidiff

from app.tasksets.formats.common import Converted, unknown_keys
from app.tasksets.formats.patchtext import reverse_patch

FIELDS = frozenset({"instance_id", "patch", "FAIL_TO_PASS", "PASS_TO_PASS", "image_name", "repo", "problem_statement",
                    "created_at", "base_commit"})
TEST_CMD = "pytest --disable-warnings --color=no --tb=no --verbose"
ACTIVATE = "source /opt/miniconda3/bin/activate\nconda activate testbed"


def looks_like(row: dict[str, Any]) -> bool:
    """`image_name` and a bug `patch`, without SWE-bench's `test_patch`/`version` or SWE-rebench's `install_config`."""
    return {"instance_id", "patch", "image_name", "FAIL_TO_PASS"} <= set(row) and not (
        {"install_config", "version", "test_patch", "source"} & set(row))


def eval_script(test_cmd: str, files: list[str], repo_dir: str) -> str:
    """Reset the F2P/P2P test files to the image's version, then run the tests between swebench's markers."""
    reset = f"git checkout HEAD -- {' '.join(files)}" if files else ""
    return "\n".join(["#!/bin/bash", "set -uxo pipefail", ACTIVATE, f"cd {repo_dir}", reset,
                      'export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -rA"',
                      ": '>>>>> Start Test Output'", test_cmd, ": '>>>>> End Test Output'", reset]) + "\n"


def convert_rows(rows: Sequence[dict[str, Any]]) -> list[Converted]:

    out = []
    for row in rows:
        warnings = unknown_keys(row, FIELDS, "SWE-smith")
        try:
            gold = reverse_patch(str(row.get("patch") or ""))
        except unidiff.UnidiffParseError as exc:
            out.append(Converted(None, ("patch", f"the bug patch is not a unified diff: {exc}"), warnings))
            continue
        if not gold:
            out.append(Converted(None, ("patch", "no bug patch: nothing to fix"), warnings))
            continue
        rec = {k: v for k, v in row.items() if k != "image_name"}
        repo_dir = row.get("repo_dir") or "/testbed"
        f2p, p2p = _list(row.get("FAIL_TO_PASS")), _list(row.get("PASS_TO_PASS"))
        files = sorted({t.split("::", 1)[0] for t in f2p + p2p if "::" in t and t.split("::", 1)[0].endswith(".py")})
        rec.update(
            source={"kind": "image"}, image=row["image_name"], repo_dir=repo_dir, bug_patch=row["patch"], patch=gold,
            base_commit=row.get("base_commit") or "", test_files=files,
            eval_script=row.get("eval_script") or eval_script(
                row.get("test_cmd") or " ".join([TEST_CMD, *sorted({t.split("::", 1)[0] for t in f2p})]), files, repo_dir),
            log_parser=row.get("log_parser") or "parse_log_pytest_v2",
        )
        out.append(Converted(rec, None, warnings))
    return out


def _list(value: Any) -> list[str]:
    from app.tasksets.formats.common import json_value

    value = json_value(value)
    return [str(v) for v in value] if isinstance(value, list) else []
