"""Running git with a fixed, config-free environment (so commit ids are reproducible).

A bottom-layer module: the runtimes build instance repositories with it, and the starter task
set's generator (`app.tasksets.starter`) builds the same commits offline.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path


class RuntimeSetupError(RuntimeError):
    """A runtime could not be prepared (download, hash, unpack, bug_patch, commit id, venv install).

    `stage` names the step that failed; the message carries the command output when there is one.
    Defined here, beside `git` which raises it, and re-exported by `app.runtimes.errors`, so a
    failed git command is the same error whichever layer ran it.
    """

    def __init__(self, stage: str, message: str):
        self.stage = stage
        super().__init__(f"{stage}: {message}")

# The identity and date of the single base commit of an sdist repository: fixed, so the same
# sdist always gives the same commit id on every machine.
SDIST_IDENTITY = {
    "GIT_AUTHOR_NAME": "sdist",
    "GIT_AUTHOR_EMAIL": "sdist@localhost",
    "GIT_AUTHOR_DATE": "2020-01-01T00:00:00+00:00",
    "GIT_COMMITTER_NAME": "sdist",
    "GIT_COMMITTER_EMAIL": "sdist@localhost",
    "GIT_COMMITTER_DATE": "2020-01-01T00:00:00+00:00",
}

# Build and test by-products that must never enter the tree or the agent's diff.
EXCLUDE_PATTERNS = (
    "*.egg-info/", "__pycache__/", "*.py[cod]", ".pytest_cache/", "/build/",
    "/dist/", ".eggs/", ".tox/", ".venv/", ".coverage",
)


def git_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for git: no global/system config, no prompts, fixed locale."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, GIT_TERMINAL_PROMPT="0", LC_ALL="C",
    )
    env.update(extra or {})
    return env


def git(repo: Path, *args: str, stage: str = "git", input: str | None = None,
        extra_env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run `git -C repo args...`; raises `RuntimeSetupError(stage)` with git's output on failure."""
    # A repository under another one (var/ inside the project checkout) must never
    # be mistaken for part of the outer one: stop discovery at the repo's parent.
    extra_env = {"GIT_CEILING_DIRECTORIES": str(Path(repo).resolve().parent), **(extra_env or {})}
    proc = subprocess.run(
        ["git", "-C", str(repo), "-c", "commit.gpgsign=false", "-c", "core.autocrlf=false", *args],
        input=input, capture_output=True, text=True, env=git_env(extra_env),
    )
    if check and proc.returncode != 0:
        raise RuntimeSetupError(stage, f"git {' '.join(args[:3])} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc


def write_excludes(repo: Path) -> None:
    """Append `EXCLUDE_PATTERNS` to `repo`'s `.git/info/exclude` (created if missing)."""
    info = repo / ".git" / "info"
    info.mkdir(parents=True, exist_ok=True)
    with open(info / "exclude", "a", encoding="utf-8") as fh:
        fh.write("\n".join(EXCLUDE_PATTERNS) + "\n")
