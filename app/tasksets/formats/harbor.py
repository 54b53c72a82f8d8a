"""Harbor task folders (https://harborframework.com/docs/tasks), read with the standard library.

A task is a folder: `task.toml`, `instruction.md` (the prompt), `environment/` (a
`Dockerfile` or `docker-compose.yaml`, or nothing when `[environment] docker_image` names a
built image), `tests/test.sh` (+ helpers; writes `/logs/verifier/reward.txt` or
`reward.json`), optional `solution/solve.sh` (the oracle).  A dataset is a folder of task
folders.  `task.toml` keys (Harbor `src/harbor/models/task/config.py`, schema 1.x):
`version`/`schema_version`, `[task]`, `[metadata]` (free-form), `[verifier] timeout_sec env
user network_mode allowed_hosts`, `[agent] timeout_sec user ...`, `[environment]
build_timeout_sec docker_image cpus memory_mb memory storage_mb gpus gpu_types
allow_internet mcp_servers env skills_dir healthcheck`, `[solution] env`.

The folder the agent works in (whose changes are carried into the grading runtime) is
`[metadata] repo_dir` when set (metadata is free-form in Harbor), else `/app`, the working
directory of Terminal-Bench's images and verifiers' `HarborEnv(agent_workdir="/app")`.

The `harbor` package needs Python >= 3.12, so the file is parsed with `tomllib`.  Refused at
load, with the reason: a task with no `docker_image` ("needs a built image": nothing is
built here), no `instruction.md`, or no `tests/test.sh`.
"""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from app.tasksets.formats.common import Converted

SECTIONS = {
    "task": {"name", "description", "authors", "keywords"},
    "metadata": None,  # free-form
    "verifier": {"timeout_sec", "env", "user", "network_mode", "allowed_hosts", "collect", "environment_mode"},
    "agent": {"timeout_sec", "user", "network_mode", "allowed_hosts"},
    "environment": {"build_timeout_sec", "docker_image", "cpus", "memory_mb", "memory", "storage_mb", "storage",
                    "gpus", "gpu_types", "allow_internet", "mcp_servers", "env", "skills_dir", "healthcheck"},
    "solution": {"env"},
}
TOP = {"version", "schema_version"}


def task_dirs(path: Path) -> list[Path]:
    """The task folders under `path`: itself when it holds `task.toml`, else its subfolders that do (sorted)."""
    if (path / "task.toml").is_file():
        return [path]
    return sorted(p.parent for p in path.glob("*/task.toml") if p.is_file())


def unknown(config: dict[str, Any]) -> list[str]:
    """Warnings naming keys of `task.toml` that Harbor's schema does not define."""
    out = [f"unknown task.toml key {k!r}" for k in sorted(set(config) - TOP - set(SECTIONS))]
    for section, keys in SECTIONS.items():
        table = config.get(section)
        if keys is None or not isinstance(table, dict):
            continue
        out += [f"unknown task.toml key [{section}] {k!r}" for k in sorted(set(table) - keys)]
    return out


def convert_task(task_dir: Path) -> Converted:
    """One task folder → a record dict (`grader="harbor"`), or the reason it cannot be served."""
    try:
        config = tomllib.loads((task_dir / "task.toml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        return Converted(None, ("task.toml", f"cannot be read: {exc}"))
    warnings = unknown(config)
    env = config.get("environment") or {}
    verifier = config.get("verifier") or {}
    agent = config.get("agent") or {}
    image = env.get("docker_image")
    if not image:
        has = [n for n in ("Dockerfile", "docker-compose.yaml") if (task_dir / "environment" / n).is_file()]
        what = f"only environment/{has[0]}" if has else "no [environment] docker_image"
        return Converted(None, ("environment.docker_image", f"needs a built image: {what}, and images are not "
                                                             "built here (build and push it, then set docker_image)"),
                         warnings)
    instruction = task_dir / "instruction.md"
    if not instruction.is_file():
        return Converted(None, ("instruction.md", "missing: the task has no prompt"), warnings)
    tests = task_dir / "tests"
    if not (tests / "test.sh").is_file():
        return Converted(None, ("tests/test.sh", "missing: the task cannot be graded"), warnings)
    solve = task_dir / "solution" / "solve.sh"
    name = (config.get("task") or {}).get("name") or task_dir.name
    try:
        timeout = float(verifier.get("timeout_sec", 600))
        agent_timeout = float(agent["timeout_sec"]) if "timeout_sec" in agent else None
    except (TypeError, ValueError) as exc:
        return Converted(None, ("verifier.timeout_sec", f"not a number: {exc}"), warnings)
    rec = {
        "instance_id": str(name).replace("/", "__"), "repo": str(name) if "/" in str(name) else f"harbor/{name}",
        "problem_statement": instruction.read_text(encoding="utf-8"), "source": {"kind": "image"},
        "image": image, "repo_dir": str((config.get("metadata") or {}).get("repo_dir") or "/app"), "grader": "harbor",
        "harbor": {"task_dir": str(task_dir.resolve()), "tests_dir": str(tests.resolve()),
                   "oracle": str(solve.resolve()) if solve.is_file() else None,
                   "verifier_timeout_s": timeout, "agent_timeout_s": agent_timeout,
                   "verifier_env": {str(k): str(v) for k, v in (verifier.get("env") or {}).items()},
                   "network_mode": str(verifier.get("network_mode") or "no-network")},
        "FAIL_TO_PASS": [], "PASS_TO_PASS": [], "metadata": config.get("metadata") or {},
    }
    if not solve.is_file():
        warnings.append("no solution/solve.sh: `tasks validate` cannot show the task is solvable")
    return Converted(rec, None, warnings)
