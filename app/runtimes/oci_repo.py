"""The repository folder of an image runtime: where it is, what patches are taken against, the bug, hidden files.

`repo_dir(record, image)` names the folder; `repository_facts` gives the trusted repository,
base commit and untracked-file excludes patches are taken against (`app.runtimes.patch`);
`commit_bug_patch` turns a record's `bug_patch` (SWE-smith's `patch`, the diff that *creates*
the bug) into the episode's base commit; `hide_in_workspace` removes the files an episode must
not see (R2E-Gym's runner in the repository) from its copy.

Every git command runs with `HARDENED_GIT_OPTIONS` (the image's `.git/config` is the
publisher's: no hook, fsmonitor or filter of it runs on the host).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path, PurePosixPath

from app.gitutil import EXCLUDE_PATTERNS, git_env
from app.runtimes.errors import RuntimeSetupError
from app.runtimes.images import Image, remove_tree
from app.runtimes.patch import HARDENED_GIT_OPTIONS
from app.runtimes.rootfs import resolve_inside
from app.tasksets.schema import InstanceRecord

DEFAULT_REPO_DIR = "/testbed"
# The bug commit's identity is fixed, so every runtime of a record gets the same commit id
# (the grade's base equals the episode's; SWE-smith names its own bug commits "Bug Patch").
BUG_IDENTITY = {"GIT_AUTHOR_NAME": "turnstile", "GIT_AUTHOR_EMAIL": "turnstile@localhost",
                "GIT_COMMITTER_NAME": "turnstile", "GIT_COMMITTER_EMAIL": "turnstile@localhost",
                "GIT_AUTHOR_DATE": "2020-01-01T00:00:00+00:00", "GIT_COMMITTER_DATE": "2020-01-01T00:00:00+00:00"}


def record_extra(rec: InstanceRecord, name: str, default=None):
    """A field of the record, set or kept as an extra (published formats add their own)."""
    if name in type(rec).model_fields:
        return getattr(rec, name)
    return (rec.model_extra or {}).get(name, default)


def repo_dir(rec: InstanceRecord, img: Image) -> str:
    """The repository's folder inside: the record's `repo_dir` when the record sets it, else
    /testbed when the image has one (SWE-bench's layout), else the image's WorkingDir."""
    if "repo_dir" in rec.model_fields_set or (rec.model_extra or {}).get("repo_dir"):
        return str(getattr(rec, "repo_dir", None) or rec.model_extra["repo_dir"])
    return DEFAULT_REPO_DIR if resolve_inside(img.rootfs, DEFAULT_REPO_DIR) is not None else img.config.cwd


def git(cwd: Path, *args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> str:
    """`git <args>` in `cwd` with the hardened options; raises `RuntimeSetupError("repository")`."""
    proc = subprocess.run(["git", *HARDENED_GIT_OPTIONS, *args], cwd=cwd, capture_output=True, text=True,
                          env=git_env(env or {}), input=stdin)
    if proc.returncode != 0:
        raise RuntimeSetupError("repository", f"git {args[0]} in {cwd}: {proc.stderr.strip()[-1000:]}")
    return proc.stdout


def repository_facts(img: Image, repo_dir: str, base: Path, root: Path) -> tuple[Path, str, str]:
    """(trusted repository, base commit, untracked-file excludes) of the image's repository folder.

    For a folder with git history these are the same for every runtime of the image, so they are
    computed once and kept in the bundle (`git status` over a large repository costs a good part
    of a second); a folder without history gets a fresh snapshot per runtime."""
    memo = img.bundle / "repos" / (hashlib.sha256(repo_dir.encode()).hexdigest()[:24] + ".json")
    if (base / ".git").is_dir():
        try:
            facts = json.loads(memo.read_text())
            return base, facts["base_commit"], facts["untracked"]
        except (OSError, ValueError, KeyError):
            pass
    base_repo, base_commit = _base_repository(base, root)
    untracked = _untracked(base_repo, base)
    if base_repo == base:
        memo.parent.mkdir(exist_ok=True)
        tmp = memo.with_suffix(f".{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps({"base_commit": base_commit, "untracked": untracked}))
        os.replace(tmp, memo)
    return base_repo, base_commit, untracked


def _base_repository(base: Path, root: Path) -> tuple[Path, str]:
    """(trusted repository, base commit) that patches are taken against.

    The image's own repository (read-only, shared; the agent cannot change it) when the folder
    has git history; else a private snapshot of the folder as the image has it, in `root/base`."""
    if (base / ".git").is_dir():
        return base, git(base, "rev-parse", "HEAD").strip()
    snap = root / "base"
    snap.mkdir()
    git(snap, "init", "-q")
    env = {"GIT_DIR": str(snap / ".git"), "GIT_WORK_TREE": str(base)}
    git(snap, "add", "-A", "--", ".", env=env)
    git(snap, "-c", "user.name=turnstile", "-c", "user.email=turnstile@localhost", "commit", "-q",
        "--allow-empty", "-m", "image snapshot", env=env)
    return snap, git(snap, "rev-parse", "HEAD").strip()


def _untracked(base_repo: Path, base: Path) -> str:
    """gitignore lines naming the files the image already has untracked (install by-products),
    then `EXCLUDE_PATTERNS`."""
    # GIT_OPTIONAL_LOCKS=0: status must not refresh the index of the shared, read-only image copy.
    env = {"GIT_DIR": str(base_repo / ".git"), "GIT_WORK_TREE": str(base), "GIT_OPTIONAL_LOCKS": "0"}
    out = git(base, "status", "--porcelain=v1", "-z", "--untracked-files=all", env=env)
    lines = []
    for item in out.split("\0"):
        if item.startswith("?? "):
            lines.append("/" + item[3:].replace("\\", "\\\\").replace("*", "\\*").replace("?", "\\?")
                         .replace("[", "\\[").replace("!", "\\!").replace("#", "\\#"))
    # Plus what commands leave behind (caches, build folders), as LocalRuntime's workspaces exclude it.
    return "".join(line + "\n" for line in [*lines, *EXCLUDE_PATTERNS])


def commit_bug_patch(bug_patch: str, base_repo: Path, base_commit: str, workspace: Path, root: Path,
                     instance_id: str) -> tuple[Path, str]:
    """Apply `bug_patch` on top of the image's repository and commit it; returns (trusted
    repository, bug commit), the base the agent's patch is taken against from then on.

    The commit is made in a private repository (`root/base`: the image's objects as alternates
    when `base_repo` is the shared image repository), with `git apply --cached` (no file of
    the image is touched) and a fixed identity, so every runtime of the record gets the same
    id.  The workspace gets the patched files and, when it has git history, the commit's
    objects and its branch moved there (`git status` inside is clean, `git log` shows the bug
    commit: what SWE-smith's own branch checkout gives).  Raises `RuntimeSetupError("bug_patch")`
    when the patch does not apply to the image's repository (naming the instance).
    """
    private = root / "base"
    if base_repo != private:
        private.mkdir()
        git(private, "init", "-q")
        (private / ".git" / "objects" / "info" / "alternates").write_text(str(base_repo / ".git" / "objects") + "\n")
    env = {"GIT_DIR": str(private / ".git"), "GIT_INDEX_FILE": str(root / "bug.index"), **BUG_IDENTITY}
    patch_file = root / "bug.diff"
    patch_file.write_text(bug_patch, encoding="utf-8", errors="surrogateescape")
    try:
        git(private, "read-tree", base_commit, env=env)
        try:
            git(private, "apply", "--cached", "--whitespace=nowarn", str(patch_file), env=env)
        except RuntimeSetupError as exc:
            raise RuntimeSetupError("bug_patch", f"instance {instance_id}'s bug patch does not apply to the "
                                                 f"image's repository at {base_commit[:12]}: {exc}") from None
        tree = git(private, "write-tree", env=env).strip()
        commit = git(private, "commit-tree", tree, "-p", base_commit, "-m", "Bug Patch", env=env).strip()
        git(private, "update-ref", "HEAD", commit, env=env)
        # The files: the same patch on the workspace's copy (plain files, no index).
        git(workspace, "apply", "--whitespace=nowarn", str(patch_file),
            env={"GIT_DIR": str(private / ".git"), "GIT_WORK_TREE": str(workspace)})
        if (workspace / ".git").is_dir():
            _carry_objects(private / ".git" / "objects", workspace / ".git" / "objects")
            git(workspace, "reset", "-q", commit)  # the branch and index to the bug commit; files stay
    finally:
        patch_file.unlink(missing_ok=True)
        (root / "bug.index").unlink(missing_ok=True)
    return private, commit


def _carry_objects(src: Path, dst: Path) -> None:
    """Copy the loose objects of `src` (the bug commit: a few trees and blobs) into `dst`."""
    for folder in src.iterdir():
        if len(folder.name) != 2 or not folder.is_dir():
            continue  # info/, pack/
        (dst / folder.name).mkdir(exist_ok=True)
        for obj in folder.iterdir():
            target = dst / folder.name / obj.name
            if not target.exists():
                shutil.copyfile(obj, target)


def hide_in_workspace(workspace: Path, repo_dir: str, hidden: list[str]) -> list[str]:
    """Remove the `hidden` paths that lie inside the repository from the episode's copy of it;
    returns them as repository-relative paths.  The image keeps them: a grade runtime (which
    hides nothing) sees them."""
    inside = []
    root = PurePosixPath(repo_dir)
    for path in hidden:
        p = PurePosixPath(path)
        if root not in p.parents:
            continue
        rel = str(p.relative_to(root))
        target = workspace / rel
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            remove_tree(target)
        inside.append(rel)
    return inside
