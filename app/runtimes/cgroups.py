"""Per-command control groups: a process cap and a memory cap over every process of one sandbox run.

Rules (kernel documentation, https://docs.kernel.org/admin-guide/cgroup-v2.html and
https://docs.kernel.org/admin-guide/cgroup-v1/pids.html):

* cgroup v2: a child group of this process's group, with `pids.max` and `memory.max`
  (`memory.swap.max` 0); needs the `pids` and `memory` controllers enabled in the parent's
  `cgroup.subtree_control` (enabled here when the parent allows it) and a writable parent.
* cgroup v1 (a `pids` and/or a `memory` hierarchy mounted writable): a child group in each, with
  `pids.max` and `memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes` when swap is accounted).
* A fork over `pids.max` fails with EAGAIN and counts in `pids.events` (`max N`); a group over its
  memory limit is reclaimed, then OOM-killed (`oom_kill N` in `memory.events` (v2) or
  `memory.oom_control` (v1)).  tmpfs pages count against the writer's memory group.

Processes join by writing their PID to `cgroup.procs` *before* exec (`join_prefix`), so nothing the
command forks escapes.  `create` returns None when no writable hierarchy exists (an unprivileged
container): the caller then falls back to rlimits.
"""
from __future__ import annotations

import functools
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "turnstile-"


@dataclass(frozen=True)
class _Mount:
    version: int           # 1 or 2
    controllers: frozenset  # v1: the controllers of this hierarchy; v2: the parent's available ones
    parent: Path           # this process's own group in that hierarchy


def _own_groups() -> dict[str, str]:
    """`/proc/self/cgroup` as {controller or "" (v2): path}."""
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _hid, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            out[name.removeprefix("name=")] = path
    return out


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(fstype, mount point, root inside the hierarchy, super options) of cgroup mounts (mountinfo)."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if rfields and rfields[0] in ("cgroup", "cgroup2"):
            out.append((rfields[0], fields[4], fields[3], set(rfields[2].split(",")) if len(rfields) > 2 else set()))
    return out


def _inside(mount_point: str, root: str, group_path: str) -> Path | None:
    rel = os.path.relpath(group_path, root) if group_path.startswith(root) else None
    if rel is None:
        return None
    return Path(mount_point) / ("" if rel == "." else rel)


def _can_join(m: _Mount) -> bool:
    """Whether a child group can be made under `m.parent` and a process moved into it (a writable
    folder alone does not prove the kernel lets this process move others)."""
    probe = m.parent / f"{PREFIX}probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        probe.mkdir()
    except OSError:
        return False
    try:
        done = subprocess.run(["/bin/sh", "-c", 'echo $$ > "$0"', str(probe / "cgroup.procs")],
                              capture_output=True, timeout=10)
        return done.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        for _ in range(50):
            try:
                probe.rmdir()
                break
            except OSError:
                time.sleep(0.01)


@functools.lru_cache(maxsize=1)
def _hierarchies() -> tuple[_Mount, ...]:
    """The writable hierarchies holding `pids` or `memory` for this process (v2 preferred), each
    checked by moving a probe process into a child group."""
    return tuple(m for m in _candidates() if _can_join(m))


def _candidates() -> tuple[_Mount, ...]:
    try:
        groups, mounts = _own_groups(), _mounts()
    except OSError:
        return ()
    v2 = [m for m in mounts if m[0] == "cgroup2"]
    for _fs, point, root, _opts in v2:
        parent = _inside(point, root, groups.get("", "/"))
        if parent is None or not os.access(parent, os.W_OK):
            continue
        try:
            available = set((parent / "cgroup.controllers").read_text().split())
        except OSError:
            continue
        wanted = {"pids", "memory"} & available
        if not wanted:
            continue
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
        for name in wanted - enabled:
            try:
                (parent / "cgroup.subtree_control").write_text(f"+{name}")
            except OSError:
                pass  # e.g. the parent holds processes itself ("no internal processes" rule)
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
        if wanted & enabled:
            return (_Mount(2, frozenset(wanted & enabled), parent),)
    out = []
    for name in ("pids", "memory"):
        for _fs, point, root, opts in mounts:
            if _fs == "cgroup" and name in opts and name in groups:
                parent = _inside(point, root, groups[name])
                if parent is not None and os.access(parent, os.W_OK) and (parent / "cgroup.procs").exists():
                    out.append(_Mount(1, frozenset({name}), parent))
                    break
    return tuple(out)


def available() -> dict[str, str]:
    """{"pids" | "memory": "v1" | "v2"} that `create` can cap here (empty: none, rlimits only)."""
    return {c: f"v{m.version}" for m in _hierarchies() for c in m.controllers}


@dataclass
class CGroup:
    """One command's control group(s); `close()` kills what is left and removes them."""

    max_processes: int | None
    memory_bytes: int | None
    dirs: list[tuple[int, frozenset, Path]] = field(default_factory=list)

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for _v, _c, d in self.dirs]

    def join_prefix(self) -> list[str]:
        """argv prefix that moves the shell into every group, then execs the command (`-- CMD…` follows)."""
        script = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *self.procs_files(), "--"]

    def _read(self, controller: str, name: str) -> dict[str, int]:
        for _v, controllers, d in self.dirs:
            if controller in controllers:
                try:
                    pairs = (line.split() for line in (d / name).read_text().splitlines())
                    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].lstrip("-").isdigit()}
                except OSError:
                    return {}
        return {}

    def limit_hit(self) -> str | None:
        """One line naming the cap the command ran into (process cap, memory cap), or None."""
        hits = []
        refused = self._read("pids", "pids.events").get("max", 0)
        if refused and self.max_processes:
            hits.append(f"process limit reached: {self.max_processes} processes "
                        f"(TURNSTILE_SANDBOX_MAX_PROCESSES), {refused} forks refused")
        version = next((v for v, c, _d in self.dirs if "memory" in c), None)
        events = self._read("memory", "memory.events" if version == 2 else "memory.oom_control")
        if events.get("oom_kill", 0) and self.memory_bytes:
            hits.append(f"memory limit reached: {self.memory_bytes // 2**20} MiB (TURNSTILE_SANDBOX_MEMORY_MB), "
                        f"{events['oom_kill']} processes OOM-killed")
        return "; ".join(hits) or None

    def close(self) -> None:
        """SIGKILL every process still in the groups, then remove them (best effort, ≤ 2 s)."""
        for _v, _c, d in self.dirs:
            deadline = time.monotonic() + 2.0
            while True:
                try:
                    pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
                except OSError:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    d.rmdir()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.02)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@functools.lru_cache(maxsize=1)
def _sweep_once() -> int:
    """Remove the empty groups left by worker processes that died (once per process); returns how many."""
    removed = 0
    for m in _hierarchies():
        try:
            names = [p for p in m.parent.iterdir() if p.name.startswith(PREFIX)]
        except OSError:
            continue
        for d in names:
            owner = d.name[len(PREFIX):].split("-", 1)[0]
            if owner.isdigit() and not _pid_alive(int(owner)):
                try:
                    d.rmdir()  # fails (EBUSY) while processes are still in it: left alone
                    removed += 1
                except OSError:
                    pass
    return removed


def create(max_processes: int | None, memory_bytes: int | None) -> CGroup | None:
    """A new group capping processes and memory, or None where no writable hierarchy has either."""
    hierarchies = _hierarchies()
    if not hierarchies or not (max_processes or memory_bytes):
        return None
    _sweep_once()
    group = CGroup(max_processes, memory_bytes)
    name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        for m in hierarchies:
            d = m.parent / name
            d.mkdir()
            group.dirs.append((m.version, m.controllers, d))
            if "pids" in m.controllers and max_processes:
                (d / "pids.max").write_text(str(max_processes))
            if "memory" in m.controllers and memory_bytes:
                if m.version == 2:
                    (d / "memory.max").write_text(str(memory_bytes))
                    if (d / "memory.swap.max").exists():
                        (d / "memory.swap.max").write_text("0")
                else:
                    (d / "memory.limit_in_bytes").write_text(str(memory_bytes))
                    if (d / "memory.memsw.limit_in_bytes").exists():
                        (d / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
    except OSError:
        group.close()
        return None
    return group
