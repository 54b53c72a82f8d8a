"""Extract an episode's patch: `git diff` of the workspace against the base commit, new files included.

The workspace's own `.git` is agent-controlled: its config can name an
fsmonitor hook, a diff driver or a clean filter, any of which git would run *on
the host*.  So when the trusted base repository is known, git runs with
`--git-dir=<base>/.git --work-tree=<workspace>`, a throwaway index and a
throwaway object directory (the base's objects as alternates): only our config
applies and nothing is written to the base.  Without a base repository, the
workspace's git is used with hooks, fsmonitor, external diff and textconv
switched off.

By-products never enter the patch: `.git/info/exclude` carries the by-product patterns
(`gitutil.write_excludes`: build folders, caches, egg-info), and `extra_excludes` (a gitignore-format
file, e.g. files the venv install left in the tree) is added on top.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from app.gitutil import git_env

# Config that decides what a diff looks like or runs a program, pinned on the command
# line, which wins over every config file (https://git-scm.com/docs/git#Documentation/git.txt--cltnamegtltvaluegt).
HARDENED_GIT_OPTIONS = ("-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", "-c", "diff.external=",
                        "-c", "core.quotePath=false", "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false",
                        "-c", "diff.relative=false", "-c", "core.autocrlf=false", "-c", "core.safecrlf=false",
                        "-c", "core.symlinks=true", "-c", "core.ignoreCase=false")
# The diff options that fix its format whatever the config says.
DIFF_FORMAT_OPTIONS = ("--binary", "--no-color", "--no-ext-diff", "--no-textconv", "--no-relative",
                       "--src-prefix=a/", "--dst-prefix=b/")


class PatchError(RuntimeError):
    """git could not compute the diff (message has git's stderr)."""


def patch_from_workspace(
    workspace: Path,
    base_commit: str | None = None,
    *,
    base_repo: Path | None = None,
    extra_excludes: Path | None = None,
) -> str:
    """Unified diff (text, `git diff --binary` format, a/ b/ prefixes) of `workspace` against `base_commit`.

    `base_commit` defaults to the root commit of the history (the single sdist
    commit).  Added, deleted, modified and mode-changed files are included; ignored
    files are not.  Returns "" when nothing changed.  Raises `PatchError`.
    """
    workspace = Path(workspace)
    with tempfile.TemporaryDirectory(prefix="turnstile-diff-") as tmp:
        env = git_env({"GIT_INDEX_FILE": os.path.join(tmp, "index"),
                       "GIT_CEILING_DIRECTORIES": str(workspace.resolve().parent)})
        if base_repo is not None:
            objects = os.path.join(tmp, "objects")
            os.mkdir(objects)
            env.update(GIT_DIR=str(Path(base_repo) / ".git"), GIT_WORK_TREE=str(workspace),
                       GIT_OBJECT_DIRECTORY=objects,
                       GIT_ALTERNATE_OBJECT_DIRECTORIES=str(Path(base_repo) / ".git" / "objects"))
        opts = list(HARDENED_GIT_OPTIONS)
        if extra_excludes is not None and Path(extra_excludes).is_file():
            opts += ["-c", f"core.excludesFile={extra_excludes}"]

        def run(*args: str) -> str:
            proc = subprocess.run(["git", *opts, *args], cwd=workspace, env=env, capture_output=True)
            if proc.returncode != 0:
                raise PatchError(f"git {args[0]} failed: {proc.stderr.decode(errors='replace').strip()[-2000:]}")
            return proc.stdout.decode("utf-8", errors="surrogateescape")

        if base_commit is None:
            base_commit = run("rev-list", "--max-parents=0", "HEAD").split()[-1]
        run("read-tree", base_commit)
        run("add", "-A", "--", ".")
        diff = run("diff", "--cached", *DIFF_FORMAT_OPTIONS, base_commit)
    return diff
