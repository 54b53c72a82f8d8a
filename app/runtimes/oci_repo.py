"""The repository folder of an image runtime: where it is, what patches are taken against, the bug, hidden files.

`repo_dir(record, image)` names the folder; `repository_facts` gives the trusted repository,
base commit and untracked-file excludes patches are taken against (`app.runtimes.patch`);
`commit_bug_patch` turns a record's `bug_patch` (SWE-smith's `patch`, the diff that *creates*
the bug) into the episode's base commit; `hide_in_workspace` removes the files an episode must
not see (R2E-Gym's runner in the repository) from its copy.

The image's `.git` is never git's repository on the host (`app.runtimes.rootfs`'s rule): the
trusted repository is a private one of ours in the runtime's folder (`image_git.trusted_repository`,
borrowing only the checked object folder of the image), and every git command runs with
`GIT_DIR` explicit, `HARDENED_GIT_OPTIONS` and `image_git.HARDENED_GIT_ENV`.  Host-side writes
into the workspace copy (hidden paths, the bug commit's objects, branch and index) go through
`rootfs.inside_no_links` or are refused.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path, PurePosixPath

from app.gitutil import EXCLUDE_PATTERNS, git_env
from app.runtimes.errors import RuntimeSetupError
from app.runtimes.image_git import HARDENED_GIT_ENV, head_commit, image_git_dir, trusted_repository
from app.runtimes.images import Image, remove_tree
from app.runtimes.patch import HARDENED_GIT_OPTIONS, gitignore_literal, nested_repositories
from app.runtimes.rootfs import OutsideCopy, inside_no_links, resolve_inside
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


def git(git_dir: Path, *args: str, work_tree: Path | None = None, env: dict[str, str] | None = None,
        check: bool = True) -> str:
    """`git <args>` on the repository `git_dir` (explicit `GIT_DIR`, `GIT_WORK_TREE` when given,
    run from `git_dir`'s folder, so nothing is discovered) with the hardened options; raises
    `RuntimeSetupError("repository")`."""
    run_env = {**HARDENED_GIT_ENV, "GIT_DIR": str(git_dir), "GIT_CEILING_DIRECTORIES": str(git_dir.parent.parent),
               **({"GIT_WORK_TREE": str(work_tree)} if work_tree is not None else {}), **(env or {})}
    proc = subprocess.run(["git", *HARDENED_GIT_OPTIONS, *args], cwd=work_tree or git_dir.parent, capture_output=True,
                          text=True, env=git_env(run_env))
    if check and proc.returncode != 0:
        raise RuntimeSetupError("repository", f"git {args[0]} in {git_dir}: {proc.stderr.strip()[-1000:]}")
    return proc.stdout


def repository_facts(img: Image, repo_dir: str, base: Path, root: Path) -> tuple[Path, str, str]:
    """(trusted repository, base commit, untracked-file excludes) of the image's repository folder
    `repo_dir` (inside; `base` its host path).

    With git history the trusted repository is `root/base`, private (`image_git.trusted_repository`);
    the image's git directory is found and checked once per image, its facts kept in the bundle
    (`git status` over a large repository costs a good part of a second).  Without history it is
    a private snapshot of the folder as the image has it.  Raises `RuntimeSetupError("repository")`
    for a git history that cannot be read without leaving the image (`image_git`)."""
    memo = img.bundle / "repos" / (hashlib.sha256(repo_dir.encode()).hexdigest()[:24] + ".json")
    try:
        facts = json.loads(memo.read_text())
        trusted = trusted_repository(root / "base", Path(facts["git_dir"]), facts["base_commit"])
        return trusted, facts["base_commit"], facts["untracked"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    gitdir = image_git_dir(img.rootfs, repo_dir)
    nested = "".join(f"{gitignore_literal(p)}/\n" for p in nested_repositories(base))
    if gitdir is None:
        snap, commit = _snapshot(base, root, nested)
        return snap, commit, _untracked(snap, base, commit, root, nested)
    commit = head_commit(gitdir)
    trusted = trusted_repository(root / "base", gitdir, commit)
    git(trusted / ".git", "cat-file", "-e", f"{commit}^{{commit}}")
    untracked = _untracked(trusted, base, commit, root, nested)
    memo.parent.mkdir(exist_ok=True)
    tmp = memo.with_suffix(f".{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps({"git_dir": str(gitdir), "base_commit": commit, "untracked": untracked}))
    os.replace(tmp, memo)
    return trusted, commit, untracked


def _snapshot(base: Path, root: Path, nested: str) -> tuple[Path, str]:
    """(private repository, its one commit) holding the folder `base` as the image has it."""
    snap = root / "base"
    snap.mkdir()
    git(snap / ".git", "init", "-q")
    (snap / ".git" / "info").mkdir(exist_ok=True)
    (snap / ".git" / "info" / "exclude").write_text(nested)
    git(snap / ".git", "add", "-A", "--", ".", work_tree=base, env={"GIT_INDEX_FILE": str(root / "snap.index")})
    git(snap / ".git", "-c", "user.name=turnstile", "-c", "user.email=turnstile@localhost", "commit", "-q",
        "--allow-empty", "-m", "image snapshot", work_tree=base, env={"GIT_INDEX_FILE": str(root / "snap.index")})
    (root / "snap.index").unlink(missing_ok=True)
    return snap, git(snap / ".git", "rev-parse", "HEAD").strip()


def _untracked(trusted: Path, base: Path, commit: str, root: Path, nested: str) -> str:
    """gitignore lines naming the files the image already has untracked (install by-products;
    nested repositories are kept out by their own lines), then `EXCLUDE_PATTERNS`."""
    index, excludes = root / "facts.index", root / "facts.exclude"
    excludes.write_text(nested)
    env = {"GIT_INDEX_FILE": str(index)}
    try:
        git(trusted / ".git", "read-tree", commit, env=env)
        out = git(trusted / ".git", "-c", f"core.excludesFile={excludes}", "ls-files", "-z", "--others",
                  "--exclude-standard", work_tree=base, env=env)
    finally:
        index.unlink(missing_ok=True)
        excludes.unlink(missing_ok=True)
    lines = [gitignore_literal(item) for item in out.split("\0") if item]
    # Plus what commands leave behind (caches, build folders), as LocalRuntime's workspaces exclude it.
    return "".join(line + "\n" for line in [*lines, *EXCLUDE_PATTERNS])


def own_git_dir(workspace: Path, rootfs: Path, repo_dir: str) -> None:
    """Make the workspace copy's `.git` a real folder of the copy: a `.git` link or `gitdir:`
    file is replaced by a copy of the git directory it names inside the image (`image_git_dir`,
    checked), so neither host nor sandbox git goes through it."""
    dotgit = workspace / ".git"
    if not os.path.lexists(dotgit) or (dotgit.is_dir() and not dotgit.is_symlink()):
        return
    gitdir = image_git_dir(rootfs, repo_dir)
    dotgit.unlink()
    if gitdir is None:
        return
    subprocess.run(["cp", "-a", "--reflink=auto", str(gitdir), str(dotgit)], check=True, capture_output=True)


def commit_bug_patch(bug_patch: str, base_repo: Path, base_commit: str, workspace: Path, root: Path,
                     instance_id: str) -> tuple[Path, str]:
    """Apply `bug_patch` on top of the image's repository and commit it; returns (trusted
    repository, bug commit), the base the agent's patch is taken against from then on.

    The commit is made in the private trusted repository `base_repo` (`repository_facts`), with
    `git apply --cached` (no file of the image is touched) and a fixed identity, so every runtime
    of the record gets the same id.  The workspace gets the patched files (`git apply` refuses a
    path beyond a link) and, when it has git history, the commit's objects, its branch and an
    index of the commit written there by us (`git status` inside is clean, `git log` shows the bug
    commit: what SWE-smith's own branch checkout gives); git never runs on the workspace's own
    `.git`.  Raises `RuntimeSetupError("bug_patch")` when the patch does not apply to the image's
    repository (naming the instance), `RuntimeSetupError("repository")` when the workspace's git
    folder cannot be written without leaving it.
    """
    private = base_repo / ".git"
    env = {"GIT_INDEX_FILE": str(root / "bug.index"), **BUG_IDENTITY}
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
        (private / "HEAD").write_text(commit + "\n")
        # The files: the same patch on the workspace's copy (plain files; a throwaway index).
        git(private, "apply", "--whitespace=nowarn", str(patch_file), work_tree=workspace,
            env={"GIT_INDEX_FILE": str(root / "bug.index")})
        if (workspace / ".git").is_dir() and not (workspace / ".git").is_symlink():
            _move_workspace_branch(private, workspace, commit, root)
    finally:
        patch_file.unlink(missing_ok=True)
        (root / "bug.index").unlink(missing_ok=True)
    return base_repo, commit


def _move_workspace_branch(private: Path, workspace: Path, commit: str, root: Path) -> None:
    """What `git reset <commit>` in the workspace would do, without running git on its `.git`:
    the new loose objects copied in, HEAD's branch (or a detached HEAD) moved, the index written.
    Every path goes through `inside_no_links`."""
    try:
        for folder in (private / "objects").iterdir():
            if len(folder.name) != 2 or not folder.is_dir():
                continue  # info/, pack/
            for obj in folder.iterdir():
                target = inside_no_links(workspace, f".git/objects/{folder.name}/{obj.name}")
                target.parent.mkdir(exist_ok=True)
                if not os.path.lexists(target):
                    shutil.copyfile(obj, target)
        head = inside_no_links(workspace, ".git/HEAD")
        value = head.read_text().strip() if head.is_file() and not head.is_symlink() else ""
        ref = value.removeprefix("ref:").strip() if value.startswith("ref:") else ""
        if ref and not (re.fullmatch(r"refs/[A-Za-z0-9._/@+-]+", ref) and ".." not in ref):
            raise OutsideCopy(f"HEAD names {ref[:80]!r}")
        _write_file(inside_no_links(workspace, f".git/{ref}" if ref else ".git/HEAD"), commit + "\n")
        index = root / "workspace.index"
        env = {"GIT_INDEX_FILE": str(index)}
        # No `update-index --refresh` here: it would open the repository a submodule's `.git`
        # names; the first `git status` inside fills in the files' stat data.
        git(private, "read-tree", commit, env=env)
        _write_file(inside_no_links(workspace, ".git/index"), index.read_bytes())
        index.unlink()
    except OutsideCopy as exc:
        raise RuntimeSetupError("repository", f"the workspace's .git cannot be written without leaving it: {exc}") from None


def _write_file(path: Path, data: str | bytes) -> None:
    """Replace `path` (its folders checked by the caller) by a new file: a link there is replaced,
    never followed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def hide_in_workspace(workspace: Path, repo_dir: str, hidden: list[str]) -> list[str]:
    """Remove the `hidden` paths that lie inside the repository from the episode's copy of it;
    returns them as repository-relative paths.  The image keeps them: a grade runtime (which
    hides nothing) sees them.

    A hidden path itself a link is removed as a link.  Raises `RuntimeSetupError("repository")`
    when a folder on the way to one is a link: what the sandbox would show there is elsewhere in
    the image (or nowhere), and removing through it would delete what the link names on the host."""
    inside = []
    root = PurePosixPath(repo_dir)
    for path in hidden:
        p = PurePosixPath(path)
        if root not in p.parents:
            continue
        rel = str(p.relative_to(root))
        try:
            target = inside_no_links(workspace, rel)
        except OutsideCopy as exc:
            raise RuntimeSetupError("repository", f"hidden path {path} cannot be hidden in the workspace copy: "
                                                  f"{exc}") from None
        if target.is_symlink() or (os.path.lexists(target) and not target.is_dir()):
            target.unlink()
        elif target.is_dir():
            remove_tree(target)
        inside.append(rel)
    return inside
