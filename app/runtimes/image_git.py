"""The history of an image's repository, read by host git without leaving the image.

An image's `.git` is the publisher's.  Used as git's repository directly, it decides what the
host reads and writes: a `.git` that is a link or a `gitdir:` file naming a host repository,
an `objects/info/alternates` or `commondir` naming a host path, a config with `[include]`,
`core.worktree` or hooks.  So host git never uses it as its repository:

* `image_git_dir` finds the git directory as a chrooted process would (`.git` a folder, a link
  or a `gitdir:` file, each resolved inside the rootfs by `rootfs.resolve_inside`) and
  `check_git_dir` refuses one that holds a link, a special file, a `commondir` or alternates
  (through them git would read outside the rootfs);
* `head_commit` reads HEAD (a commit id or a chain of `ref:` names, loose or packed) in Python;
* `trusted_repository` makes a private repository of ours (`HARDENED_GIT_ENV`: our config, no
  hook, no replace refs, no system or global config) whose only link to the image is its object
  folder, named in our own `objects/info/alternates`.  Every host git command on the image's
  history (prepare, patch, grade) runs there, with `GIT_DIR` explicit.

`RuntimeSetupError("repository")` names the image's path that was refused.
"""
from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path, PurePosixPath

from app.runtimes.errors import RuntimeSetupError
from app.runtimes.rootfs import resolve_inside

# Set for every host git command on an image's history or a workspace (with GIT_DIR and
# GIT_WORK_TREE explicit): replace refs and grafts could make a commit id name other content.
HARDENED_GIT_ENV = {"GIT_NO_REPLACE_OBJECTS": "1", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
                    "GIT_TERMINAL_PROMPT": "0", "GIT_ALLOW_PROTOCOL": "file", "GIT_OPTIONAL_LOCKS": "0"}
_OID = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_REF_NAME = re.compile(r"refs/[A-Za-z0-9._/@+-]+")
MAX_SYMREFS = 5


def _refuse(what: str) -> RuntimeSetupError:
    return RuntimeSetupError("repository", f"the image's git history cannot be read safely: {what}")


def image_git_dir(rootfs: Path, repo_dir: str) -> Path | None:
    """Host path of the git directory of `repo_dir` (a path inside the image), found as git in a
    chroot would find it, checked by `check_git_dir`; None when the folder has no `.git`.

    Raises `RuntimeSetupError("repository")` when `.git` is there but names nothing inside the
    image (a link or `gitdir:` out of it, a loop) or is unsafe (`check_git_dir`)."""
    inside = str(PurePosixPath(repo_dir) / ".git")
    folder = resolve_inside(rootfs, repo_dir)
    entry = folder / ".git" if folder is not None else None
    if entry is None or not os.path.lexists(entry):
        return None
    link = os.readlink(entry) if os.path.islink(entry) else None
    host = resolve_inside(rootfs, inside)
    if host is not None and host.is_file():
        text = host.read_text(encoding="utf-8", errors="replace").strip()
        if not text.startswith("gitdir:"):
            raise _refuse(f"{inside} is a file that is not a `gitdir:` file")
        target = PurePosixPath(text.partition(":")[2].strip())
        link = str(target)
        # A relative gitdir is read from the folder of the .git file, as git reads it.
        where = PurePosixPath("/") / host.parent.relative_to(rootfs)
        host = resolve_inside(rootfs, str(target if target.is_absolute() else where / target))
    if host is None or not host.is_dir():
        raise _refuse(f"{inside}{f' (-> {link})' if link else ''} names no git directory inside the image")
    check_git_dir(host)
    return host


def check_git_dir(gitdir: Path) -> None:
    """Raise `RuntimeSetupError("repository")` when the git directory `gitdir` (a host path)
    holds anything through which git would read outside it: a link anywhere in it, a device
    node, FIFO or socket, a `commondir` file, or `objects/info/alternates` / `http-alternates`
    (`gitdir` itself a link or no folder is refused too)."""
    if os.path.islink(gitdir) or not gitdir.is_dir():
        raise _refuse(f"{gitdir} is {'a link' if os.path.islink(gitdir) else 'not a folder'}")
    for name in ("commondir", "objects/info/alternates", "objects/info/http-alternates"):
        if os.path.lexists(gitdir / name):
            raise _refuse(f"its git directory has {name} (git would read objects or refs outside it)")
    for folder, dirs, files in os.walk(gitdir):
        for name in dirs + files:
            st = os.lstat(os.path.join(folder, name))
            if stat.S_ISLNK(st.st_mode):
                rel = os.path.relpath(os.path.join(folder, name), gitdir)
                raise _refuse(f".git/{rel} is a link (-> {os.readlink(os.path.join(folder, name))})")
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                raise _refuse(f".git/{os.path.relpath(os.path.join(folder, name), gitdir)} is not a file or folder")


def head_commit(gitdir: Path) -> str:
    """The commit id HEAD names in a checked git directory (a detached id, or `ref:` names
    followed through loose refs and `packed-refs`, at most `MAX_SYMREFS` deep).  Raises
    `RuntimeSetupError("repository")` when it names none."""
    name = "HEAD"
    for _ in range(MAX_SYMREFS):
        value = _read_ref(gitdir, name)
        if value is None:
            raise _refuse(f"HEAD names {name}, which the repository does not have")
        if _OID.fullmatch(value):
            return value
        target = value.removeprefix("ref:").strip() if value.startswith("ref:") else ""
        if not _REF_NAME.fullmatch(target) or ".." in target:
            raise _refuse(f"{name} holds {value[:80]!r}, not a commit id or a ref name")
        name = target
    raise _refuse(f"HEAD is a chain of more than {MAX_SYMREFS} symbolic refs")


def _read_ref(gitdir: Path, name: str) -> str | None:
    loose = gitdir / name
    if loose.is_file():
        return loose.read_text(encoding="utf-8", errors="replace").strip()
    packed = gitdir / "packed-refs"
    if packed.is_file():
        for line in packed.read_text(encoding="utf-8", errors="replace").splitlines():
            oid, _, ref = line.partition(" ")
            if ref == name and _OID.fullmatch(oid):
                return oid
    return None


def trusted_repository(dest: Path, gitdir: Path, commit: str) -> Path:
    """Make `dest/.git`, a private repository of ours at `commit` (detached HEAD) that reads the
    objects of the checked `gitdir` through its own alternates and copies only its
    `info/exclude` and `shallow` (plain files: `check_git_dir` allows nothing else); returns `dest`."""
    git = dest / ".git"
    for sub in ("objects/info", "refs/heads", "refs/tags", "info"):
        (git / sub).mkdir(parents=True, exist_ok=True)
    (git / "HEAD").write_text(commit + "\n")
    (git / "config").write_text("[core]\n\trepositoryformatversion = 0\n\tbare = false\n")
    (git / "objects" / "info" / "alternates").write_text(str(gitdir / "objects") + "\n")
    for name in ("info/exclude", "shallow"):
        if (gitdir / name).is_file():
            shutil.copyfile(gitdir / name, git / name)
    return dest
