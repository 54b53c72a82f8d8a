"""An unpacked image's root filesystem as the sandbox sees it, read on the host without leaving it.

Everything in an image is the publisher's: a path in it may be a symbolic link to `/etc/shadow`
or `../../..`.  Two rules keep host files out of reach:

* `resolve_inside(rootfs, path)` resolves a path the way the kernel would after a chroot into
  `rootfs` (absolute links restart at the rootfs, `..` stops at it), so what the host reads or
  copies is always under the rootfs;
* `layout_args` hands bubblewrap only real folders and files of the rootfs as bind sources
  (bwrap resolves a source on the host, before it changes root); a link at the top level becomes
  a `--symlink` inside, resolved later, in the sandbox's own root.

The rule for every host process that touches an image or a copy of it (unpack, prepare, patch,
grade): **nothing the image or the agent holds makes the host read or write outside the rootfs
or the episode's own copy.**  In practice:

* a path of the image is read through `resolve_inside` (as if chrooted), never by the host's
  own lookup of a path that may go through one of the image's links;
* a host-side write into a workspace copy (hidden paths removed, a bug commit's objects, ref
  and index) goes through `inside_no_links`: every folder on the way is a real folder of the
  copy, or the write is refused;
* host git never opens a git directory of the image or the workspace as its repository: it runs
  with `GIT_DIR` and `GIT_WORK_TREE` explicit, on a private git directory of ours (our config,
  no hooks, no replace refs) that borrows only the image's object folder, after
  `app.runtimes.image_git.check_git_dir` found no link, `commondir` or alternates in it
  (`alternates`, `gitdir:` files, `core.worktree`, `[include]` of the image's git are never
  read); nested `.git` entries in a work tree are kept out of git's walk
  (`app.runtimes.patch.nested_repositories`), since git reads the repository such a `.git`
  names.

`libc_check(rootfs, programs)` says whether host programs (the harness's Python or Node) can
run on the image's C library.
"""
from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path, PurePosixPath
from typing import Sequence

MAX_LINKS = 40  # the kernel's own limit on links followed in one lookup (path_resolution(7))
SKIP_TOP = {"proc", "dev", "sys", "tmp", "run"}  # the sandbox makes its own
LIB_DIRS = ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib64", "usr/lib64", "lib", "usr/lib")


def resolve_inside(rootfs: Path, path: str) -> Path | None:
    """Host path of `path` (absolute, as seen inside) with every link resolved inside `rootfs`;
    None when it does not exist or loops.  The result never leaves `rootfs`."""
    parts = [p for p in PurePosixPath(path).parts if p != "/"]
    done: list[str] = []
    hops = 0
    while parts:
        name = parts.pop(0)
        if name in (".", ""):
            continue
        if name == "..":
            if done:
                done.pop()
            continue
        host = rootfs.joinpath(*done, name)
        try:
            st = os.lstat(host)
        except OSError:
            return None
        if os.path.islink(host):
            hops += 1
            if hops > MAX_LINKS:
                return None
            target = os.readlink(host)
            if target.startswith("/"):
                done = []
            parts = [p for p in PurePosixPath(target).parts if p != "/"] + parts
            continue
        del st
        done.append(name)
    return rootfs.joinpath(*done)


class OutsideCopy(ValueError):
    """A host-side path of an image or workspace copy that would leave it (through a link)."""


def inside_no_links(root: Path, rel: str) -> Path:
    """`root / rel` when no folder on the way from `root` is a link and `rel` does not climb
    (`..`, absolute); the last component may be anything, or missing.  Raises `OutsideCopy`
    naming the link otherwise: the caller writes or deletes there, and a link would take it to
    wherever the image or the agent pointed it."""
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
        raise OutsideCopy(f"{rel!r} is not a relative path inside {root}")
    here = root
    for name in parts[:-1]:
        here = here / name
        if os.path.islink(here):
            raise OutsideCopy(f"{here.relative_to(root)} is a link (-> {os.readlink(here)})")
        if not here.is_dir():
            break  # missing on the way: nothing to follow
    return root.joinpath(*parts)


def layout_args(rootfs: Path, dests: Sequence[str], hidden: Sequence[str] = ()) -> list[str]:
    """bwrap arguments that rebuild `rootfs` read-only on a tmpfs root.

    Each top-level entry is a read-only bind (folders, files) or a symlink; `proc`, `dev`,
    `sys`, `tmp`, `run` are left out (the caller mounts its own).  `dests` are the sandbox paths
    the caller mounts next (workspace, HOME, harness tools): a folder that would have to hold a
    missing mount point is rebuilt one level deeper (a `--dir` holding binds of its entries),
    because bwrap cannot create a mount point inside a read-only bind; an entry that is itself a
    destination is left for the caller's mount.  `hidden` paths (absolute, as seen inside) are
    left out the same way: a folder holding one is rebuilt one level deeper without it, so
    it does not exist inside (R2E-Gym's hidden tests in an episode).
    """
    wanted = [PurePosixPath(d) for d in dests]
    return _layout(rootfs, rootfs, PurePosixPath("/"), wanted, [PurePosixPath(h) for h in hidden])


def _layout(rootfs: Path, host_dir: Path, inside_dir: PurePosixPath, dests: list[PurePosixPath],
            hidden: list[PurePosixPath] = ()) -> list[str]:
    args: list[str] = []
    with os.scandir(host_dir) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        inside = inside_dir / entry.name
        if inside_dir == PurePosixPath("/") and entry.name in SKIP_TOP:
            continue
        if inside in dests or inside in hidden:
            continue
        if entry.is_symlink():
            # A link over a mount destination would send that mount wherever the image points it
            # (into the workspace, say): the destination wins, the link is left out.
            if not any(inside in d.parents for d in dests):
                args += ["--symlink", os.readlink(entry.path), str(inside)]
        elif entry.is_dir(follow_symlinks=False):
            if (any(inside in d.parents and resolve_inside(rootfs, str(d)) is None for d in dests)
                    or any(inside in h.parents for h in hidden)):
                mode = oct(entry.stat(follow_symlinks=False).st_mode & 0o7777)[2:]
                args += ["--perms", mode.zfill(4), "--dir", str(inside)]
                args += _layout(rootfs, Path(entry.path), inside, dests, hidden)
            else:
                args += ["--ro-bind", entry.path, str(inside)]
        elif entry.is_file(follow_symlinks=False):
            args += ["--ro-bind", entry.path, str(inside)]
        # sockets, fifos and device nodes are left out: nothing in an image needs one
    return args


def is_musl(rootfs: Path) -> str | None:
    """The musl loader's name (e.g. `ld-musl-x86_64.so.1`) when the image's C library is musl."""
    for d in ("lib", "usr/lib"):
        folder = resolve_inside(rootfs, "/" + d)
        if folder is not None and folder.is_dir():
            for p in folder.glob("ld-musl-*"):
                return p.name
    return None


def _glibc_versions(data: bytes) -> int:
    found = [int(m) for m in re.findall(rb"GLIBC_2\.(\d+)", data)]
    return max(found, default=0)


@functools.lru_cache(maxsize=64)
def _program_needs(program: str, _mtime: int) -> tuple[int, tuple[str, ...]]:
    """(highest GLIBC_2.N symbol version the program or its private libraries ask for,
    sonames of the system libraries it links), from the file's bytes and the host's `ldd`."""
    need = _glibc_versions(Path(program).read_bytes())
    proc = subprocess.run(["ldd", program], capture_output=True, text=True)
    system: list[str] = []
    prefix = str(Path(program).resolve().parent.parent)
    for line in proc.stdout.splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+(\S+)", line)
        if not m:
            continue
        soname, host = m.groups()
        if host.startswith(prefix + "/"):
            need = max(need, _glibc_versions(Path(host).read_bytes()))  # e.g. libpython, mounted with it
        else:
            system.append(soname)
    return need, tuple(system)


def libc_check(rootfs: Path, programs: Sequence[Path]) -> str | None:
    """Why `programs` (host executables, mounted into the image) cannot run on the image's C
    library, in one line; None when they can.

    A musl image cannot load glibc programs; a glibc image needs the x86-64 loader, a libc.so.6
    at least as new as the newest GLIBC_2.N symbol version the programs ask for, and every
    system library they link (by soname, in the image's library folders).
    """
    musl = is_musl(rootfs)
    if musl:
        return f"its C library is musl ({musl}), and the mounted programs are built for glibc"
    if resolve_inside(rootfs, "/lib64/ld-linux-x86-64.so.2") is None:
        return "it has no glibc loader /lib64/ld-linux-x86-64.so.2"
    libc = next((p for d in LIB_DIRS if (p := resolve_inside(rootfs, f"/{d}/libc.so.6")) is not None), None)
    if libc is None:
        return "it has no libc.so.6"
    have = _glibc_versions(libc.read_bytes())
    for program in programs:
        need, sonames = _program_needs(str(program), int(os.stat(program).st_mtime))
        if need > have:
            return f"{program} needs glibc 2.{need} and the image has glibc 2.{have}"
        for soname in sonames:
            if soname.startswith(("linux-vdso", "ld-linux")):
                continue
            if not any(resolve_inside(rootfs, f"/{d}/{soname}") is not None for d in LIB_DIRS):
                return f"{program} links {soname}, which the image does not have"
    return None
