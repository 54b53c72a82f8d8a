"""R2E-Gym rows: per-commit images with hidden tests, graded by exact match of every test status.

Row (HF `R2E-Gym/R2E-Gym-Subset`, read by rLLM's `rllm/data/r2egym_builder.py`): `repo_name,
docker_image, commit_hash, parsed_commit_content` (JSON: the commit's `file_diffs`),
`execution_result_content, expected_output_json` (JSON: {test id: status}), `modified_files,
relevant_files, prompt, problem_statement`.  The image holds the repository at /testbed, the
hidden tests in `/r2e_tests` and the runner in the repository, `/testbed/run_tests.sh`, which
runs `r2e_tests` from /testbed (R2E-Gym `agenthub/runtime/docker.py::setup_env` moves both out
of the agent's reach, to /root, and links /testbed/r2e_tests back for the reward run).
Here the record names them in `hidden_paths` (`/r2e_tests`, `<repo_dir>/run_tests.sh`,
`<repo_dir>/r2e_tests`): an episode's runtime does not have them, a grade's does.

Reward (R2E-Gym `_calculate_reward_r2e`): run the runner, parse the pytest log, strip ` - <msg>`
from the ids of both maps, and give 1 only when the parsed map has the same ids as
`expected_output_json` with equal statuses.  The gold patch is the commit's non-test files
(`ParsedCommit.get_patch(test_file=False)`).  R2E-Gym's pytest parser is its own
(`repo_analysis/execution_log_parser.py`), keyed `Class.test` (the file part dropped);
swebench's `parse_log_pytest` reads the same `-rA` summary lines, and `verifier.r2e_match`
compares both in R2E-Gym's form.
"""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

from app.tasksets.formats.common import Converted, json_value, unknown_keys
from app.tasksets.formats.patchtext import r2e_commit_patch

FIELDS = frozenset({"repo_name", "docker_image", "commit_hash", "parsed_commit_content", "execution_result_content",
                    "expected_output_json", "modified_files", "relevant_files", "prompt", "problem_statement",
                    "instance_id", "num_non_test_files", "num_non_test_func_methods", "num_non_test_lines"})
RUNNER = "run_tests.sh"  # in the repository folder
HIDDEN_TESTS = "/r2e_tests"


def hidden_paths(repo_dir: str) -> list[str]:
    """What an episode must not see: the hidden tests and the runner (and a link to them in the repository)."""
    return [HIDDEN_TESTS, f"{repo_dir.rstrip('/')}/{RUNNER}", f"{repo_dir.rstrip('/')}/r2e_tests"]


def looks_like(row: dict[str, Any]) -> bool:
    return "expected_output_json" in row or {"docker_image", "repo_name"} <= set(row)


def convert_rows(rows: Sequence[dict[str, Any]]) -> list[Converted]:
    out = []
    for row in rows:
        warnings = unknown_keys(row, FIELDS, "R2E-Gym")
        expected = json_value(row.get("expected_output_json"))
        if not isinstance(expected, dict) or not expected:
            out.append(Converted(None, ("expected_output_json", "must be a JSON object of test id -> status"), warnings))
            continue
        parsed = json_value(row.get("parsed_commit_content"))
        try:
            gold = r2e_commit_patch(parsed, test_files=False) if isinstance(parsed, dict) else ""
        except (KeyError, TypeError) as exc:
            out.append(Converted(None, ("parsed_commit_content", f"not a parsed commit ({type(exc).__name__}: {exc})"),
                                 warnings))
            continue
        if not row.get("docker_image"):
            out.append(Converted(None, ("docker_image", "no image: the environment cannot be served"), warnings))
            continue
        repo = str(row.get("repo_name") or "")
        commit = str(row.get("commit_hash") or "")
        iid = row.get("instance_id") or f"{repo}__{commit[:12] or hashlib.sha256(str(row).encode()).hexdigest()[:12]}"
        statuses = {str(k).split(" - ")[0]: str(v) for k, v in expected.items()}
        rec = dict(row)
        repo_dir = str(row.get("repo_dir") or "/testbed")
        rec.update(instance_id=iid, repo=repo or "unknown/unknown", source={"kind": "image"},
                   image=row["docker_image"], repo_dir=repo_dir, grader="r2egym", hidden_paths=hidden_paths(repo_dir),
                   base_commit=commit, patch=gold, expected_statuses=statuses,
                   FAIL_TO_PASS=[k for k, v in statuses.items() if v == "PASSED"], PASS_TO_PASS=[],
                   problem_statement=row.get("problem_statement") or row.get("prompt") or "",
                   log_parser="parse_log_pytest", test_cmd=f"bash {RUNNER}")
        out.append(Converted(rec, None, warnings))
    return out
