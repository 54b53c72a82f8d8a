"""Materialize an instance's base repository (the tree the agent starts from), cached per instance.

`pypi_sdist` / `inline` (files in the record): unpack the sdist or write the files, `git init -b
main`, append the by-product patterns to `.git/info/exclude`, apply `bug_patch`
(synthetic instances) *before* the only commit, `git add -A`, commit as `sdist
<sdist@localhost>` at 2020-01-01T00:00:00+00:00 with message `<name> <version>`.
The resulting commit id must equal `sdist_base_commit` when the record has one.

`git` (the SWE-bench default): clone from a bare mirror cached under
`<cache>/mirrors/` (fetched once from `source.url` or `https://github.com/<repo>.git`),
check out `base_commit` as branch `main`, and drop the remote, every other ref,
the reflog and all unreachable objects, so no commit after `base_commit` (the
fix) is reachable or even present.

The result lives at `<cache>/bases/<instance_id>-<key>/repo`, where `key` hashes
the fields that shape the tree; a changed record gets a new base.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from app.runtimes.errors import RuntimeSetupError
from app.gitutil import SDIST_IDENTITY, git, git_env, write_excludes
from app.runtimes.paths import RuntimePaths, build_lock
from app.runtimes.sdist import fetch_sdist, unpack_sdist
from app.tasksets.schema import InstanceRecord


def base_key(record: InstanceRecord) -> str:
    """16 hex digits identifying the base tree (source, bug_patch, base_commit)."""
    src = record.source.model_dump(mode="json") if record.source else {"kind": "git"}
    blob = json.dumps({"source": src, "bug_patch": record.bug_patch,
                       "base_commit": record.base_commit if record.source_kind == "git" else None,
                       "repo": record.repo}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:80]


def base_path(record: InstanceRecord, paths: RuntimePaths) -> Path:
    return paths.bases / f"{_safe(record.instance_id)}-{base_key(record)}" / "repo"


def materialize_base(record: InstanceRecord, paths: RuntimePaths) -> Path:
    """Path of the cached base repository for `record`, building it once (file-locked).

    Raises `RuntimeSetupError` (stage download/sha256/unpack/bug_patch/commit/commit_id/git).
    """
    target = base_path(record, paths)
    if (target / ".git" / "HEAD").exists():
        return target
    with build_lock(target.parent.with_suffix(".lock")):
        if (target / ".git" / "HEAD").exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
        try:
            repo = work / "repo"
            if record.source_kind == "pypi_sdist":
                _build_from_sdist(record, paths, repo)
            elif record.source_kind == "inline":
                _build_from_inline(record, repo)
            else:
                _build_from_git(record, paths, repo)
            repo.rename(target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def _build_from_inline(record: InstanceRecord, repo: Path) -> None:
    """Write the record's `files` into `repo`, then bug_patch and commit exactly as for an sdist."""
    repo.mkdir()
    for rel, text in sorted(record.source.files.items()):
        target = repo / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    _commit_base(record, repo)


def _build_from_sdist(record: InstanceRecord, paths: RuntimePaths, repo: Path) -> None:
    archive = fetch_sdist(record.source, paths)
    unpack_sdist(archive, repo)
    _commit_base(record, repo)


def _commit_base(record: InstanceRecord, repo: Path) -> None:
    """git init, bug_patch, one commit with the fixed sdist identity; checks `sdist_base_commit`."""
    src = record.source
    git(repo, "init", "-q", "-b", "main", stage="commit")
    write_excludes(repo)
    if record.bug_patch:
        # git init came first so `git apply` treats this folder as the repo root
        # (it would otherwise find the project checkout above var/).
        git(repo, "apply", "--whitespace=nowarn", "-", input=record.bug_patch, stage="bug_patch")
    git(repo, "add", "-A", stage="commit")
    git(repo, "commit", "-q", "-m", f"{src.name} {src.version}", stage="commit", extra_env=SDIST_IDENTITY)
    head = git(repo, "rev-parse", "HEAD", stage="commit").stdout.strip()
    if record.sdist_base_commit and head != record.sdist_base_commit:
        raise RuntimeSetupError(
            "commit_id", f"{record.instance_id}: base commit {head} != sdist_base_commit {record.sdist_base_commit} "
            "(archive, bug_patch or git settings differ from the recipe)")


def _mirror(record: InstanceRecord, paths: RuntimePaths) -> Path:
    url = (getattr(record.source, "url", None) if record.source else None) or f"https://github.com/{record.repo}.git"
    mirror = paths.mirrors / (hashlib.sha256(url.encode()).hexdigest()[:16] + "-" + _safe(record.repo.replace("/", "__")) + ".git")
    with build_lock(mirror.with_suffix(".lock")):
        env = git_env()
        if not mirror.exists():
            paths.mirrors.mkdir(parents=True, exist_ok=True)
            tmp = mirror.with_name(mirror.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            proc = subprocess.run(["git", "clone", "-q", "--mirror", url, str(tmp)], capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                raise RuntimeSetupError("mirror", f"git clone --mirror {url}: {proc.stderr.strip()[-2000:]}")
            tmp.rename(mirror)
        if git(mirror, "cat-file", "-e", f"{record.base_commit}^{{commit}}", check=False).returncode != 0:
            git(mirror, "fetch", "-q", "--prune", "origin", stage="mirror")
    return mirror


def _build_from_git(record: InstanceRecord, paths: RuntimePaths, repo: Path) -> None:
    mirror = _mirror(record, paths)
    proc = subprocess.run(["git", "clone", "-q", "--no-checkout", "--no-hardlinks", str(mirror), str(repo)],
                          capture_output=True, text=True, env=git_env())
    if proc.returncode != 0:
        raise RuntimeSetupError("clone", proc.stderr.strip()[-2000:])
    if git(repo, "cat-file", "-e", f"{record.base_commit}^{{commit}}", check=False).returncode != 0:
        raise RuntimeSetupError("clone", f"{record.repo} has no commit {record.base_commit}")
    git(repo, "checkout", "-q", "-B", "main", record.base_commit, stage="checkout")
    git(repo, "remote", "remove", "origin", stage="checkout")
    refs = git(repo, "for-each-ref", "--format=%(refname)", stage="checkout").stdout.split()
    for ref in refs:
        if ref != "refs/heads/main":
            git(repo, "update-ref", "-d", ref, stage="checkout")
    git(repo, "reflog", "expire", "--expire=now", "--all", stage="checkout")
    git(repo, "gc", "-q", "--prune=now", stage="checkout")
    write_excludes(repo)
