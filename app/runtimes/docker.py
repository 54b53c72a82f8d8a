"""`DockerRuntime`: an episode in a SWE-bench instance image, where a Docker engine exists.

Uses the `docker` CLI (no SDK dependency).  The image is the record's `image`
or SWE-bench's name `swebench/sweb.eval.x86_64.<id with __ → _1776_>:latest`
(swebench 5.0.2 `harness/run_evaluation.py`); the repository is at /testbed and
the environment is the image's conda env `testbed`.  The container starts with
`--network none` (or a named Docker network that holds only the gateway), with
memory / CPU / PID limits, and is removed by `close()`.

A `Runtime` (`app.runtimes.base`): `prepare`, `describe`/`attach`, `run`, `patch`, `close`.
No engine here, so its tests skip (`docker_available()` is False).
"""
from __future__ import annotations

import functools
import shutil
import subprocess
import time
import uuid
from typing import Sequence

from app.runtimes.base import Runtime, as_record
from app.runtimes.errors import RuntimeSetupError
from app.runtimes.patch import DIFF_FORMAT_OPTIONS, HARDENED_GIT_OPTIONS, PatchError
from app.runtimes.sandbox import RunResult
from app.tasksets.schema import InstanceRecord

WORKDIR = "/testbed"


ENGINES = ("docker", "podman")  # CLIs with the same `run`/`exec`/`rm` surface


@functools.lru_cache(maxsize=2)
def docker_available(engine: str = "docker") -> bool:
    """True when the `engine` CLI (docker or podman) exists *and* answers `<engine> info`.

    `podman info` also answers where podman cannot start a container (Debian 12's crun refuses
    hybrid cgroup v1/v2 hosts: "cgroups in hybrid mode not supported"); `prepare` then fails with
    the engine's message."""
    if not shutil.which(engine):
        return False
    try:
        return subprocess.run([engine, "info"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def swebench_image(record: InstanceRecord) -> str:
    if record.image:
        return record.image
    return f"swebench/sweb.eval.x86_64.{record.instance_id.replace('__', '_1776_')}:latest".lower()


class DockerRuntime(Runtime):
    """A running container of the instance image (state: container id, image, engine)."""

    kind = "docker"

    @classmethod
    def prepare(cls, record: InstanceRecord | dict, *, image: str | None = None, docker_network: str | None = None,
                memory_mb: int = 8192, cpus: float = 2.0, pids: int = 4096, engine: str = "docker") -> "DockerRuntime":
        """Start a container (`<engine> run -d`, engine docker or podman); raises
        `RuntimeSetupError(engine)` when it cannot."""
        rec = as_record(record)
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, not {engine!r}")
        if not docker_available(engine):
            raise RuntimeSetupError(engine, f"no {engine} engine usable here (`{engine} info` failed)")
        name = f"turnstile-{uuid.uuid4().hex[:12]}"
        img = image or swebench_image(rec)
        argv = [engine, "run", "-d", "--name", name, "--network", docker_network or "none",
                f"--memory={memory_mb}m", f"--cpus={cpus}", f"--pids-limit={pids}", "-w", WORKDIR,
                img, "tail", "-f", "/dev/null"]
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeSetupError(engine, f"{engine} run {img}: {proc.stderr.strip()[-2000:]}")
        return cls({"kind": cls.kind, "engine": engine, "id": name, "container": proc.stdout.strip(), "image": img,
                    "instance_id": rec.instance_id, "base_commit": rec.base_commit, "confined": True})

    workdir = property(lambda self: WORKDIR)

    def run(self, cmd: str | Sequence[str], *, env: dict[str, str] | None = None, timeout_s: float = 600,
            network: str = "none", stdin: str | None = None) -> RunResult:
        """`docker exec` in /testbed with the conda env `testbed` active; 124 + timed_out on timeout.
        `network` is the container's, fixed at prepare (`docker_network`)."""
        self._check_open()
        shell = cmd if isinstance(cmd, str) else " ".join(_quote(c) for c in cmd)
        script = f"source /opt/miniconda3/bin/activate testbed 2>/dev/null || true; {shell}"
        argv = [self._state.get("engine", "docker"), "exec", *(["-i"] if stdin is not None else []), "-w", WORKDIR]
        for k, v in (env or {}).items():
            argv += ["-e", f"{k}={v}"]
        argv += [self._state["container"], "timeout", "-k", "5", str(int(timeout_s)), "/bin/bash", "-c", script]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout_s + 30)
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, out, err = 124, (exc.stdout or b"").decode(errors="replace"), ""
        return RunResult(code, out, err, code == 124, time.monotonic() - t0, True, network)

    def patch(self) -> str:
        """The agent's changes as a unified diff (a/ b/ prefixes) against the base commit.
        Raises `RuntimeClosed`, `PatchError`."""
        self._check_open()
        res = self.run(container_diff_command(self._state["base_commit"] or "HEAD"))
        if res.exit_code != 0:
            raise PatchError(f"git diff in container failed (exit {res.exit_code}): {res.stderr.strip()[:1000]}")
        return res.stdout

    def _release(self) -> None:
        """Remove the container (`<engine> rm -f`)."""
        subprocess.run([self._state.get("engine", "docker"), "rm", "-f", self._state["container"]],
                       capture_output=True)


def container_diff_command(base: str) -> str:
    """Shell command printing the diff of the current repository against `base`.

    The agent owns the container's repository and its `.git/config`, which could set
    `diff.noprefix`, a mnemonic prefix, an external diff, a textconv or an fsmonitor hook.
    So the format is pinned on the command line, global and system config are ignored,
    and a throwaway index is used (the agent's index is left alone).
    """
    opts = " ".join(_quote(o) for o in HARDENED_GIT_OPTIONS)
    fmt = " ".join(_quote(o) for o in DIFF_FORMAT_OPTIONS)
    return ("export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null; idx=$(mktemp) && "
            f"GIT_INDEX_FILE=$idx git {opts} read-tree {_quote(base)} && "
            f"GIT_INDEX_FILE=$idx git {opts} add -A -- . && "
            f"GIT_INDEX_FILE=$idx git {opts} diff --cached {fmt} {_quote(base)}; rc=$?; rm -f \"$idx\"; exit $rc")


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)
