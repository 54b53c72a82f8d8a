"""The bubblewrap command line and environment of one command in an image runtime.

`image_environment` builds a command's environment from the image config's Env; `image_bwrap_argv`
builds the bwrap argv: a tmpfs root rebuilt read-only from the image's rootfs
(`rootfs.layout_args`, minus the runtime's hidden paths), /proc, /dev, /tmp, /run, then the
runtime's mounts (repository copy, HOME, host tools, grading files; a host Python installation
with its installed packages hidden, `exposure.prefix_args`), the image's uid/gid,
and for `network="gateway"` the in-sandbox listener that bridges to the gateway's socket.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from app.runtimes.exposure import is_python_prefix, prefix_args
from app.runtimes.rootfs import layout_args, resolve_inside
from app.runtimes.sandbox import BRIDGE_SOCKET, INIT_PATH, MIB, SANDBOX_HOME, Mount

TESTBED_ENV = "/opt/miniconda3/envs/testbed"
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def image_environment(rootfs: Path, image_env: dict[str, str], env: dict[str, str] | None = None,
                      path_prepend: Sequence[str] = ()) -> dict[str, str]:
    """The full environment of a command: the image's Env, then HOME/TMPDIR/..., then `env`.

    PATH is `path_prepend`, the image's `testbed` env when it has one (SWE-bench images:
    /opt/miniconda3/envs/testbed), then the image's PATH."""
    out = dict(image_env)
    path = [*path_prepend]
    if resolve_inside(rootfs, TESTBED_ENV + "/bin") is not None:
        path.append(TESTBED_ENV + "/bin")
        out.update(VIRTUAL_ENV=TESTBED_ENV, CONDA_DEFAULT_ENV="testbed", CONDA_PREFIX=TESTBED_ENV)
    path.append(out.get("PATH") or BASE_PATH)
    out.update(PATH=":".join(path), HOME=SANDBOX_HOME, TMPDIR="/tmp", TERM="dumb", PYTHONUNBUFFERED="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    out.setdefault("LANG", "C.UTF-8")
    out.update(env or {})
    return out


def image_bwrap_argv(command: list[str], *, rootfs: Path, mounts: list[Mount], workdir: str, env: dict[str, str],
                     uid: int, gid: int, tmpfs_mb: int | None, hidden: Sequence[str] = (),
                     gateway: tuple[str, int] | None = None) -> list[str]:
    """bwrap argv running `command` over the image `rootfs`.

    `hidden`: absolute paths of the image left out of the sandbox's root (they do not exist
    inside).  `gateway`: (Python executable on the host, port inside) of the listener that
    bridges 127.0.0.1:<port> to the gateway socket, or None for no network at all.
    """
    # As in sandbox.bwrap_argv: --cap-drop ALL also when the worker is root (CAP_SYS_ADMIN
    # inside could remount a read-only bind read-write).  The root is a tmpfs rebuilt from
    # the image, so mount points for the workspace, HOME and host tools can be made.
    def tmpfs(path: str, mib: int | None) -> list[str]:
        return (["--size", str(mib * MIB)] if mib else []) + ["--tmpfs", path]

    argv = ["bwrap", "--unshare-all", "--unshare-user", "--uid", str(uid), "--gid", str(gid), "--cap-drop", "ALL",
            "--die-with-parent", "--new-session", "--hostname", "sandbox", *tmpfs("/", tmpfs_mb)]
    argv += layout_args(rootfs, [m.dst for m in mounts] + [SANDBOX_HOME], hidden=hidden)
    argv += ["--proc", "/proc", "--dev", "/dev"]
    if tmpfs_mb:
        argv += [*tmpfs("/dev/shm", tmpfs_mb), "--remount-ro", "/dev"]
    argv += [*tmpfs("/tmp", tmpfs_mb), *tmpfs("/run", 16 if tmpfs_mb else None)]
    for m in mounts:
        if not m.writable and is_python_prefix(m.src):
            # A host interpreter (the gateway listener's, a harness's): its standard library
            # only, never its site-packages or any other installed Python (app.runtimes.exposure).
            argv += prefix_args(m.src, m.dst)
        else:
            argv += ["--bind" if m.writable else "--ro-bind", str(m.src), m.dst]
    argv += ["--clearenv"]
    for k, v in env.items():
        argv += ["--setenv", k, v]
    argv += ["--chdir", workdir, "--"]
    if gateway is not None:
        python, port = gateway
        argv += [python, "-I", INIT_PATH, "--listen", f"127.0.0.1:{port}", "--unix", BRIDGE_SOCKET, "--"]
    return argv + command
