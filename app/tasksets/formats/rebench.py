"""SWE-rebench V2 rows: per-instance images, `install_config.test_cmd` and a named log parser.

Row (SWE-rebench/SWE-rebench-V2 `sample.json`): `instance_id, repo, base_commit, patch,
test_patch, problem_statement, FAIL_TO_PASS, PASS_TO_PASS` (lists), `image_name`
(`docker.io/swerebenchv2/<owner>-<repo>:<pr>-<sha7>`), `install_config{base_image_name,
docker_specs, install, log_parser, log_parsers, test_cmd}` (`test_cmd`: a list of commands or
one string), `language, interface, pr_description, meta, created_at`.

Grading is upstream's `scripts/eval.py`: in the repository at `/<repo name>` (not /testbed),
`git reset --hard HEAD`, then `git apply -v --3way --recount --ignore-space-change
--whitespace=nowarn` of the patch and of `test_patch`, then each `test_cmd`; the log is
parsed by the parser `install_config.log_parser` names, and the instance is resolved when
the PASSED tests are exactly FAIL_TO_PASS ∪ PASS_TO_PASS (`passed_match`).  Here the tests
run with no network (upstream uses `--network host`).  Parsers are looked up by name in
swebench's `PARSER_REGISTRY` (upstream's `lib/agent/log_parsers.py` started as swebench's;
`parse_log_pytest` and its variants are the same code); a name swebench does not have is
refused at load.
"""
from __future__ import annotations

import shlex
from typing import Any, Sequence

from app.tasksets.formats.common import Converted, json_value, unknown_keys
from app.tasksets.swebench_compat import parser_names

FIELDS = frozenset({"instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement", "FAIL_TO_PASS",
                    "PASS_TO_PASS", "image_name", "install_config", "language", "interface", "pr_description", "meta",
                    "created_at", "version", "hints_text", "environment_setup_commit", "license", "license_name"})
INSTALL_CONFIG_FIELDS = frozenset({"base_image_name", "docker_specs", "install", "log_parser", "log_parsers",
                                   "test_cmd", "python", "packages", "pip_packages", "reqs_path", "pre_install",
                                   "env_yml_path", "no_use_env"})
# scripts/eval.py::run_in_container
APPLY_FLAGS = "-v --3way --recount --ignore-space-change --whitespace=nowarn"


def looks_like(row: dict[str, Any]) -> bool:
    return "install_config" in row and "instance_id" in row


HEREDOC = "EOF_TURNSTILE_REBENCH_TEST_PATCH"


def eval_script(test_cmds: list[str], repo_dir: str, test_patch: str) -> str:
    """Upstream's steps after the patch is in: apply `test_patch` with its flags (from a heredoc, as
    swebench's eval scripts do), then the test commands between swebench's markers (so swebench's
    log reading and exit-code check apply)."""
    return "\n".join([
        "#!/bin/bash", "set -uxo pipefail", f"cd {shlex.quote(repo_dir)}",
        f"git apply {APPLY_FLAGS} - <<'{HEREDOC}'", test_patch.rstrip("\n"), HEREDOC,
        ": '>>>>> Start Test Output'", *test_cmds, ": '>>>>> End Test Output'",
    ]) + "\n"


def convert_rows(rows: Sequence[dict[str, Any]]) -> list[Converted]:
    out = []
    for row in rows:
        warnings = unknown_keys(row, FIELDS, "SWE-rebench V2")
        config = json_value(row.get("install_config"))
        if not isinstance(config, dict):
            out.append(Converted(None, ("install_config", "must be an object"), warnings))
            continue
        extra = sorted(set(config) - INSTALL_CONFIG_FIELDS)
        if extra:
            warnings.append(f"unknown install_config key(s): {', '.join(map(repr, extra))} (kept, not used)")
        cmds = config.get("test_cmd")
        cmds = [cmds] if isinstance(cmds, str) else cmds
        if not isinstance(cmds, list) or not [c for c in cmds if isinstance(c, str) and c.strip()]:
            out.append(Converted(None, ("install_config.test_cmd", "no test command"), warnings))
            continue
        parser = config.get("log_parser")
        if not parser:
            out.append(Converted(None, ("install_config.log_parser", "no log parser named"), warnings))
            continue
        if parser not in parser_names():
            out.append(Converted(None, ("install_config.log_parser",
                                        f"log parser {parser!r} is SWE-rebench V2's own; swebench's PARSER_REGISTRY "
                                        "has no parser of that name, so its log cannot be read here"), warnings))
            continue
        if HEREDOC in str(row.get("test_patch") or ""):
            out.append(Converted(None, ("test_patch", f"holds the line {HEREDOC!r} that ends its heredoc"), warnings))
            continue
        if not row.get("image_name"):
            out.append(Converted(None, ("image_name", "no image: the environment cannot be served"), warnings))
            continue
        repo = str(row.get("repo") or "")
        repo_dir = row.get("repo_dir") or f"/{repo.split('/')[-1]}"
        rec = {k: v for k, v in row.items() if k != "image_name"}
        rec.update(source={"kind": "image"}, image=row["image_name"], repo_dir=repo_dir, grader="rebench",
                   log_parser=parser, test_cmd=" && ".join(c for c in cmds if c.strip()),
                   eval_script=eval_script([c for c in cmds if c.strip()], repo_dir, str(row.get("test_patch") or "")))
        if isinstance(rec.get("created_at"), (int, float)):
            rec["created_at"] = str(rec["created_at"])
        out.append(Converted(rec, None, warnings))
    return out
