"""What a sandbox shows of the host: an allowlist of /usr, with every installed Python package hidden.

Any copy of a task's package that the agent can read is the fix: the pristine file of a
vendored tree inside an SDK (`/usr/lib/google-cloud-sdk/.../third_party/inflection`), a Debian
`python3-*` package (`/usr/lib/python3/dist-packages`), a system pip install
(`/usr/local/lib/python3.11/dist-packages`), the host interpreter's `site-packages`.  So a
sandbox's host trees are built as:

  * /usr: only its entries in `USR_ALLOW` (programs, libraries, data; not /usr/src, /usr/games),
    each bound read-only;
  * a Python installation (a prefix outside /usr: the venv's interpreter, a harness's): its
    `bin`, `lib` and `include`;
  * inside those, every *Python tree* hidden (`hidden_paths`): a folder that holds Python code
    or packages (`.py`/`.pyc` files, `__pycache__`, `*-packages`, `*.dist-info`, wheels, eggs)
    is replaced by an empty read-only folder at the highest level that is not needed
    (`PROTECTED`: /usr/lib, /usr/share, the multiarch library folder, the compilers' trees), and a
    Python file directly in a needed folder (`/usr/bin/x.py`) by an empty file.  What stays is
    the interpreters' standard libraries (`lib/pythonX.Y`, their `*-packages` hidden).

So nothing installed on the host as Python is readable inside, whatever its name or version;
the sandbox keeps what shells, git, coreutils, Node and the interpreters need.  The task's own
venv (/venv) and the harness's install are mounted apart by the runtime and are not touched:
a harness whose own install depends on the task's package (say `requests` under a Python
harness) carries that copy with it.

Hiding costs mounts, and bubblewrap's mounts are slow in number (840 of them took 7.7 s per
command here), so hiding is done at the highest folder that can go: a /usr view is about a
dozen mounts.  The walk over /usr (about 120k files, 1.5 s) is cached per process for
`CACHE_TTL_S`.
"""
from __future__ import annotations

import os
import re
import threading
import time
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Iterable, Sequence

# /usr entries a sandbox sees (each read-only), relative to /usr.
USR_ALLOW = ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "libexec", "share", "include",
             "local/bin", "local/sbin", "local/lib", "local/share")
# Folders under /usr that are needed as a whole level: a Python tree below one of them is hidden
# at the level just below it, never the folder itself (globs, relative to /usr).
PROTECTED = ("", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "libexec", "share", "include", "local",
             "local/bin", "local/sbin", "local/lib", "local/share", "lib/*-linux-gnu*", "lib/gcc", "lib/gcc/*",
             "lib/gcc/*/*", "lib/llvm-*", "lib/git-core", "share/git-core", "lib/jvm", "lib/locale", "share/perl",
             "share/perl5", "lib/*-linux-gnu*/perl", "lib/*-linux-gnu*/perl5", "lib/*-linux-gnu*/perl-base")
# An interpreter's standard library: kept, with only its `*-packages` folders hidden.
STDLIB = re.compile(r"^(?:.*/)?lib/python\d+\.\d+$")
PY_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".pyi", ".pth", ".whl", ".egg")
PY_DIR_SUFFIXES = ("-packages", ".dist-info", ".egg-info", ".egg")
CACHE_TTL_S = 300.0
# An empty folder (read-only) and an empty file that hidden paths become.
EMPTY_DIR_ARGS = ("--perms", "0555", "--size", "4096", "--tmpfs")
EMPTY_FILE = os.devnull

_cache: dict[tuple[str, tuple[str, ...]], tuple[float, tuple[tuple[str, ...], tuple[str, ...]]]] = {}
_lock = threading.Lock()


def _is_python_dir(name: str, files: Iterable[str]) -> bool:
    return name == "__pycache__" or name.endswith(PY_DIR_SUFFIXES) or any(f.endswith(PY_SUFFIXES) for f in files)


def _listing(path: str) -> tuple[list[str], list[str]] | None:
    """(sub-folders, other entries) of `path`, symbolic links left out; None when unreadable."""
    dirs, files = [], []
    try:
        with os.scandir(path) as it:
            for e in it:
                try:
                    if e.is_symlink():
                        continue  # judged where its target lives
                    (dirs if e.is_dir(follow_symlinks=False) else files).append(e.name)
                except OSError:
                    continue
    except OSError:
        return None
    return dirs, files


def _holds_python(path: str) -> bool:
    """True when any folder of the tree at `path` is a Python tree (depth first, stops at the first)."""
    stack = [path]
    while stack:
        top = stack.pop()
        listing = _listing(top)
        if listing is None:
            continue
        dirs, files = listing
        if _is_python_dir(os.path.basename(top), files):
            return True
        stack.extend(os.path.join(top, d) for d in dirs)
    return False


def _protected(rel: str, patterns: Sequence[str]) -> bool:
    # One glob segment per path segment (fnmatch's `*` would also match `/`).
    depth = rel.count("/")
    return any(p.count("/") == depth and fnmatchcase(rel, p) for p in patterns)


def hidden_paths(root: str | Path, protected: Sequence[str] = PROTECTED) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(folders, files) under host folder `root` to hide: absolute host paths, sorted.

    `protected`: globs relative to `root` ("" is `root` itself) of folders needed as a level.
    Inside a protected folder each sub-folder holding Python anywhere below is hidden whole
    unless it is protected itself (then it is searched the same way); Python files directly in
    a protected folder are hidden one by one.  A standard library folder (`lib/pythonX.Y`) is
    kept, only its `*-packages` sub-folders hidden.  Links are never followed (a link's target
    is judged where it lives).  Cached per (root, protected) for `CACHE_TTL_S` seconds.
    """
    root = os.path.realpath(str(root))
    key = (root, tuple(protected))
    now = time.monotonic()
    with _lock:
        hit = _cache.get(key)
        if hit is not None and now - hit[0] < CACHE_TTL_S:
            return hit[1]
    dirs: list[str] = []
    files: list[str] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        top = os.path.join(root, rel) if rel else root
        listing = _listing(top)
        if listing is None:
            continue
        subdirs, entries = listing
        if STDLIB.match(rel):
            dirs += [os.path.join(top, d) for d in subdirs if d.endswith("-packages")]
            continue
        files += [os.path.join(top, f) for f in entries if f.endswith(PY_SUFFIXES)]
        for d in subdirs:
            child = f"{rel}/{d}" if rel else d
            if _protected(child, protected) or STDLIB.match(child):
                stack.append(child)
            elif _holds_python(os.path.join(root, child)):
                dirs.append(os.path.join(root, child))
    result = (tuple(sorted(dirs)), tuple(sorted(files)))
    with _lock:
        _cache[key] = (now, result)
    return result


def forget() -> None:
    """Drop the cached walks (the next sandbox walks the host again)."""
    with _lock:
        _cache.clear()


def hide_args(host_root: str | Path, inside_root: str, protected: Sequence[str] = PROTECTED) -> list[str]:
    """bwrap arguments hiding `hidden_paths(host_root)` in a tree mounted at `inside_root`
    (folders become empty read-only folders, files empty files).  Put them after the mount."""
    real = os.path.realpath(str(host_root))
    dirs, files = hidden_paths(real, protected)
    args: list[str] = []
    for d in dirs:
        args += [*EMPTY_DIR_ARGS, inside_root + d[len(real):]]
    for f in files:
        args += ["--ro-bind", EMPTY_FILE, inside_root + f[len(real):]]
    return args


def usr_args(usr: str = "/usr") -> list[str]:
    """bwrap arguments for the sandbox's /usr: `USR_ALLOW` entries bound read-only, Python trees
    hidden, /usr itself a read-only tmpfs (nothing can be added beside the entries)."""
    args: list[str] = ["--perms", "0755", "--size", "65536", "--tmpfs", "/usr"]
    for entry in USR_ALLOW:
        path = os.path.join(usr, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            args += ["--ro-bind", path, f"/usr/{entry}"]
        elif os.path.islink(path):
            args += ["--symlink", os.readlink(path), f"/usr/{entry}"]
    dirs, files = hidden_paths(usr)
    allowed = tuple(os.path.join(usr, e) + "/" for e in USR_ALLOW)
    for d in dirs:
        if (d + "/").startswith(allowed) or any(a.startswith(d + "/") for a in allowed):
            args += [*EMPTY_DIR_ARGS, "/usr" + d[len(usr):]]
    for f in files:
        if f.startswith(allowed):
            args += ["--ro-bind", EMPTY_FILE, "/usr" + f[len(usr):]]
    return args + ["--remount-ro", "/usr"]


# A Python installation outside /usr: what its interpreter needs, and the levels kept.
PREFIX_ALLOW = ("bin", "lib", "lib64", "include")
PREFIX_PROTECTED = ("", "bin", "lib", "lib64", "include")


def is_python_prefix(path: str | Path) -> bool:
    """True when `path` looks like a Python installation (`bin/python3*` and `lib/python3.*`)."""
    p = Path(path)
    return p.is_dir() and any(p.glob("bin/python3*")) and any(p.glob("lib/python3.*"))


def prefix_args(prefix: str | Path, inside: str | None = None) -> list[str]:
    """bwrap arguments mounting a Python installation at `inside` (default: its own path): its
    `PREFIX_ALLOW` folders read-only, every Python tree but the standard library hidden."""
    prefix = str(prefix)
    inside = inside or prefix
    args: list[str] = ["--perms", "0755", "--size", "65536", "--tmpfs", inside]  # read-only once filled
    for entry in PREFIX_ALLOW:
        path = os.path.join(prefix, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            args += ["--ro-bind", path, f"{inside}/{entry}"]
        elif os.path.islink(path):
            args += ["--symlink", os.readlink(path), f"{inside}/{entry}"]
    dirs, files = hidden_paths(prefix, PREFIX_PROTECTED)
    real = os.path.realpath(prefix)
    allowed = tuple(os.path.join(real, e) + "/" for e in PREFIX_ALLOW)
    args += [a for d in dirs if (d + "/").startswith(allowed) for a in (*EMPTY_DIR_ARGS, inside + d[len(real):])]
    args += [a for f in files if f.startswith(allowed) for a in ("--ro-bind", EMPTY_FILE, inside + f[len(real):])]
    return args + ["--remount-ro", inside]
