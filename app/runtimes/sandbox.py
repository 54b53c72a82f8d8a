"""Run a command under bubblewrap (https://github.com/containers/bubblewrap) with limits and a timeout.

What the sandbox enforces (bwrap 0.8, Debian package `bubblewrap`):
  * Filesystem: a fresh tmpfs root holding read-only binds of an allowlist of /usr
    (`exposure.USR_ALLOW`, with the /bin, /lib, /lib64, /sbin links), an allowlist of /etc
    (`ETC_ALLOW`: no shadow, SSH keys or service configs) and the Python installation the
    venv was made from, with every installed Python tree of the host hidden but the
    interpreters' standard libraries (`app.runtimes.exposure`: Debian python3-* packages,
    system pip installs, SDKs' vendored trees, site-packages: any could hold the fix), plus
    exactly the `Mount`s given: for an episode the workspace (read-write at
    /testbed), the scratch HOME (read-write) and the venv (read-only at /venv).
    /tmp is a private tmpfs.  Nothing else of the host exists inside: not the
    project, `var/` (database, caches, other runtimes, grading files), /root, /work.
  * Namespaces: `--unshare-all` (user, pid, net, ipc, uts, cgroup); its own PID
    namespace, so `kill -9 -1` or ps see only the sandbox, and every process
    dies when the command's top process ends or on timeout.  `--die-with-parent`
    kills it when the worker dies; `--new-session` stops TIOCSTI tricks.
    Every capability is dropped (`--cap-drop ALL`), also when the worker is root.
  * Network: `none` = a network namespace with only loopback (no route out, no
    DNS); `gateway` = the same, plus a listener on 127.0.0.1:<gateway port>
    inside that is piped through a bind-mounted Unix socket to the gateway's
    address on the host (sandbox_init.py + bridge.py): the gateway is reachable,
    nothing else.  `host` (used only to build venvs, never for agents) shares
    the host network.
  * Limits (`Limits`; per-episode values from the TURNSTILE_SANDBOX_* settings):
    - processes and memory of the whole command: a control group per command
      (`app.runtimes.cgroups`: v2, else writable v1 `pids`/`memory` hierarchies) with
      `pids.max` = `nproc` and a memory limit = `memory_mb` (tmpfs files included);
      where no cgroup is writable, RLIMIT_NPROC when not root (the kernel exempts
      root, so a root worker without cgroups has no process cap: `cgroups.available()`);
    - `prlimit`: RLIMIT_DATA per process (memory; RLIMIT_AS would break Node's large
      virtual reservations), RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE=0, optional RLIMIT_CPU;
    - tmpfs: the sandbox's root, /tmp and /dev/shm are tmpfs of `tmpfs_mb` each (a write
      past it fails with ENOSPC), /run 16 MiB; /dev is read-only apart from /dev/shm;
    - disk: `execute(disk_paths=…)` sums the blocks used under the workspace and HOME every
      `DISK_POLL_S` seconds and kills the command past `disk_mb` (per file, RLIMIT_FSIZE
      stops a single write at once).
    A cap the command ran into is named in `RunResult.limit_hit`.  Wall time is enforced
    here: on timeout the process group is SIGKILLed, and with it the PID namespace.

Not enforced: kernel exploits (bwrap shares the host kernel), and reads of the files of the
allowlisted /usr and /etc entries (programs, libraries, data; no Python packages).  Without bwrap (`bwrap_available()` False) commands run
directly with the same limits and timeout, and `RunResult.confined` is False.
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

from app.runtimes import cgroups
from app.runtimes.exposure import prefix_args, usr_args

Network = Literal["none", "gateway", "host"]
INIT_PATH = "/run/turnstile/init.py"
BRIDGE_SOCKET = "/run/turnstile/gateway.sock"
SANDBOX_HOME = "/home/agent"  # the scratch HOME inside every runtime's sandbox
MAX_OUTPUT = 8 * 1024 * 1024  # bytes of stdout / stderr kept (the tail)


MIB = 1024 * 1024
DISK_POLL_S = 2.0  # how often the disk use of `disk_paths` is summed while a command runs


@dataclass(frozen=True)
class Limits:
    """Per-command resource limits.

    memory_mb: MiB, the cgroup memory limit of the whole command and each process's RLIMIT_DATA;
    nproc: processes/threads at once (cgroup pids.max, else RLIMIT_NPROC when not root);
    tmpfs_mb: MiB per sandbox tmpfs (/, /tmp, /dev/shm); disk_mb: MiB under `execute`'s
    `disk_paths` (None: unchecked); fsize_mb: MiB per file; cpu_s: RLIMIT_CPU per process, seconds.
    """

    memory_mb: int = 4096
    fsize_mb: int = 2048
    nofile: int = 4096
    nproc: int = 2048
    cpu_s: int | None = None
    tmpfs_mb: int | None = None
    disk_mb: int | None = None

    @classmethod
    def for_episodes(cls, settings) -> "Limits":
        """The caps of an episode's commands from the TURNSTILE_SANDBOX_* settings (`app.config`)."""
        return cls(memory_mb=settings.sandbox_memory_mb, nproc=settings.sandbox_max_processes,
                   tmpfs_mb=settings.sandbox_tmpfs_mb, disk_mb=settings.sandbox_disk_mb)


@dataclass(frozen=True)
class Mount:
    """Bind `src` (host path) at `dst` (sandbox path); read-only unless `writable`."""

    src: Path
    dst: str
    writable: bool = False


@dataclass
class RunResult:
    """Outcome of one command.  exit_code: the command's status (124 + timed_out on timeout); times in seconds."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    confined: bool
    network: str = "none"
    truncated: bool = False
    stopped: bool = False  # killed because `should_stop()` said so (e.g. the episode was cancelled)
    limit_hit: str | None = None  # the resource cap the command ran into (processes, memory, disk), one line

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.stopped


@functools.lru_cache(maxsize=1)
def bwrap_available() -> bool:
    """True when `bwrap` is installed *and* can create the namespaces we use here."""
    exe = shutil.which("bwrap")
    if not exe:
        return False
    try:
        proc = subprocess.run(
            [exe, "--unshare-all", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
             "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--proc", "/proc",
             "--dev", "/dev", "--", "/usr/bin/true"],
            capture_output=True, timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def _root_links() -> list[str]:
    args: list[str] = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = Path("/") / name
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            args += ["--ro-bind", str(p), str(p)]
    return args


# /etc entries the sandbox sees (read-only): what shells, git, Python, Node and TLS need.
# An allowlist, because the sandbox's root is the host's root mapped into a user
# namespace and can read root-only files: /etc/shadow, SSH host keys, service
# configs with passwords (/etc/redis, /etc/postgresql, ...) must not be there.
ETC_ALLOW = (
    "alternatives", "bash.bashrc", "ca-certificates", "ca-certificates.conf", "debian_version", "environment",
    "gai.conf", "group", "host.conf", "hosts", "inputrc", "issue", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
    "locale.alias", "locale.gen", "localtime", "login.defs", "magic", "magic.mime", "mime.types", "networks",
    "nsswitch.conf", "os-release", "passwd", "perl", "profile", "profile.d", "protocols", "python3",
    "python3.11", "resolv.conf", "services", "shells", "ssl/certs", "ssl/openssl.cnf", "terminfo", "timezone",
    "xdg",
)


def _etc_binds() -> list[str]:
    args = ["--perms", "0555", "--dir", "/etc"]
    for name in ETC_ALLOW:
        p = Path("/etc") / name
        if p.exists():
            args += ["--ro-bind", str(p), str(p)]
    return args


def bwrap_argv(
    command: Sequence[str],
    *,
    mounts: Sequence[Mount],
    workdir: str,
    env: dict[str, str],
    network: Network = "none",
    python_prefixes: Sequence[Path] = (),
    init_python: str | None = None,
    gateway_port: int | None = None,
    tmpfs_mb: int | None = None,
) -> list[str]:
    """The full `bwrap ... -- command` argv (see the module docstring for what it sets up).
    `tmpfs_mb`: size of the root, /tmp and /dev/shm tmpfs in MiB (None: the kernel's default, half the RAM)."""
    # --cap-drop ALL matters when the worker is root: bwrap then keeps every
    # capability inside the sandbox by default, and CAP_SYS_ADMIN there can
    # `mount -o remount,rw,bind` a read-only bind and write to the host (checked).
    argv = ["bwrap", "--unshare-all", "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if network == "host":
        argv.append("--share-net")

    def tmpfs(path: str, mib: int | None) -> list[str]:
        # bwrap's --size applies to the --tmpfs that follows it (bubblewrap >= 0.5).
        return (["--size", str(mib * MIB)] if mib else []) + ["--tmpfs", path]

    if tmpfs_mb:
        argv += tmpfs("/", tmpfs_mb)  # bwrap's own root tmpfs has no size: a sized one goes over it first
    argv += [*usr_args(), *_root_links(), *_etc_binds(), "--proc", "/proc", "--dev", "/dev"]
    if tmpfs_mb:
        argv += [*tmpfs("/dev/shm", tmpfs_mb), "--remount-ro", "/dev"]
    argv += [*tmpfs("/tmp", tmpfs_mb), *tmpfs("/run", 16 if tmpfs_mb else None)]
    for prefix in python_prefixes:
        if str(prefix).startswith("/usr/"):
            continue
        # Its bin/lib/include, every Python tree but the standard library hidden: the
        # interpreter's own site-packages may hold anything installed on the host (even
        # pristine copies of task packages); venvs don't use it (app.runtimes.exposure).
        argv += prefix_args(prefix)
    for m in mounts:
        argv += ["--bind" if m.writable else "--ro-bind", str(m.src), m.dst]
    argv += ["--clearenv"]
    for k, v in env.items():
        argv += ["--setenv", k, v]
    argv += ["--chdir", workdir, "--"]
    if network == "gateway":
        if not (init_python and gateway_port):
            raise ValueError("network='gateway' needs init_python and gateway_port")
        argv += [init_python, "-I", INIT_PATH, "--listen", f"127.0.0.1:{gateway_port}", "--unix", BRIDGE_SOCKET, "--"]
    return argv + list(command)


def prlimit_prefix(limits: Limits, *, nproc: bool = True) -> list[str]:
    """`prlimit … --` setting the per-process rlimits of `limits` (RLIMIT_NPROC only when `nproc`
    and not root: the kernel does not apply it to root)."""
    exe = shutil.which("prlimit")
    if not exe:
        return []
    args = [exe, f"--data={limits.memory_mb * MIB}", f"--fsize={limits.fsize_mb * MIB}",
            f"--nofile={limits.nofile}", "--core=0"]
    if limits.cpu_s:
        # SIGXCPU at the soft limit (catchable: a harness can still save its work), SIGKILL 5 s later.
        args.append(f"--cpu={limits.cpu_s}:{limits.cpu_s + 5}")
    if nproc and os.geteuid() != 0:
        args.append(f"--nproc={limits.nproc}")
    return args + ["--"]


def disk_usage_bytes(paths: Sequence[Path]) -> int:
    """Bytes of disk blocks used by the files under `paths` (st_blocks x 512, symlinks not
    followed, other filesystems' mounts included); files that vanish while counted are skipped."""
    total = 0
    stack = [str(p) for p in paths]
    while stack:
        top = stack.pop()
        try:
            with os.scandir(top) as entries:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += st.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        except OSError:
            continue
    return total


def _read_tail(fh) -> tuple[str, bool]:
    fh.seek(0, os.SEEK_END)
    size = fh.tell()
    fh.seek(max(0, size - MAX_OUTPUT))
    return fh.read().decode("utf-8", errors="replace"), size > MAX_OUTPUT


SANDBOX_OUTER_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


def execute(
    argv: Sequence[str],
    *,
    timeout_s: float,
    limits: Limits,
    confined: bool,
    network: str = "none",
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    stdin: str | bytes | None = None,
    should_stop: Callable[[], bool] | None = None,
    poll_s: float = 0.5,
    disk_paths: Sequence[Path] = (),
) -> RunResult:
    """Run `argv` under `prlimit` in its own process group and control group; SIGKILL the group
    after `timeout_s` seconds.

    `env`/`cwd` apply to the outer process (bwrap itself, or the command when unconfined).
    On timeout `exit_code` is 124 (as GNU timeout) and `timed_out` is True.  `should_stop` is
    asked every `poll_s` seconds; when it returns True the group is killed at once and the
    result has `stopped` True and exit code 130 (as after Ctrl-C).  With `limits.disk_mb` and
    `disk_paths`, the command is killed (exit 137) once those folders use more than `disk_mb`.
    A cap reached (processes, memory, disk) is named in `limit_hit`.  Exit code 125: the command
    could not be put into its control group.
    """
    group = cgroups.create(limits.nproc, limits.memory_mb * MIB)
    full = prlimit_prefix(limits, nproc=group is None) + list(argv)
    if group is not None:
        full = group.join_prefix() + full
    check_disk = bool(limits.disk_mb and disk_paths)
    disk_hit: str | None = None
    if confined and env is None:
        # bwrap's own process (PID 1 of the sandbox's PID namespace) would otherwise carry the
        # worker's whole environment (DATABASE_URL, REDIS_URL, every .env key), readable inside
        # as /proc/1/environ; the command's environment is set by `--clearenv`/`--setenv`.
        env = dict(SANDBOX_OUTER_ENV)
    started = time.monotonic()
    next_disk_check = started + DISK_POLL_S
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(
                full, stdout=out, stderr=err, env=env, cwd=cwd, start_new_session=True,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            )
        except BaseException:
            if group is not None:
                group.close()
            raise
        timed_out = stopped = False
        try:
            if stdin is not None:
                try:
                    proc.stdin.write(stdin.encode() if isinstance(stdin, str) else stdin)
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
            deadline = started + timeout_s
            while True:
                try:
                    code = proc.wait(timeout=max(0.0, min(poll_s, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline:
                        raise
                    if should_stop is not None and should_stop():
                        stopped = True
                        _kill_group(proc)
                        code = 130
                        break
                    if check_disk and time.monotonic() >= next_disk_check:
                        used = disk_usage_bytes(disk_paths)
                        next_disk_check = time.monotonic() + DISK_POLL_S
                        if used > limits.disk_mb * MIB:
                            disk_hit = (f"disk limit reached: {used / MIB:.0f} MiB used in the workspace and HOME, "
                                        f"limit {limits.disk_mb} MiB (TURNSTILE_SANDBOX_DISK_MB)")
                            _kill_group(proc)
                            code = 137
                            break
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            code = 124
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            if proc.poll() is None:
                _kill_group(proc)
            limit_hit = disk_hit
            if group is not None:
                limit_hit = "; ".join(h for h in (group.limit_hit(), disk_hit) if h) or None
                group.close()
        stdout, t1 = _read_tail(out)
        stderr, t2 = _read_tail(err)
    if code < 0:
        code = 128 - code
    return RunResult(code, stdout, stderr, timed_out, time.monotonic() - started, confined, network, t1 or t2,
                     stopped, limit_hit)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not fail
        pass


INIT_SOURCE = Path(__file__).with_name("sandbox_init.py")
