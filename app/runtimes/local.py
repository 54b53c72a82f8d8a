"""`LocalRuntime`: one episode's (or one grade's) fresh working copy, venv and sandboxed shell.

Lifecycle (what the Celery tasks call):

    rt = LocalRuntime.prepare(record)            # base + venv from cache, fresh workspace
    state = rt.describe()                        # JSON; push to the READY buffer / store on the episode
    rt = LocalRuntime.attach(state)              # in the rollout worker
    rt.run("python -m pytest -x", timeout_s=600, network="gateway")
    patch = rt.patch()                           # git diff against the base commit
    rt.close()                                   # always (or `with LocalRuntime.prepare(...) as rt:`)

Host layout `<var_dir>/runtimes/<id>/`: `workspace/` (the repository, read-write
at /testbed inside), `home/` (scratch HOME, /home/agent inside), `venv/` (plain
layout only), `grading/` (a grade's patch and eval script), `gateway.sock`.
Sandbox details and what is and is not enforced: `app.runtimes.sandbox`.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

from app.config import Settings, get_settings
from app.runtimes.bridge import GatewayBridge, gateway_port, inside_gateway_url, inside_port
from app.runtimes.environment import (
    SANDBOX_REPO,
    SANDBOX_VENV,
    apply_overlay,
    ensure_env,
    plain_runtime_venv,
)
from app.runtimes.errors import RuntimeClosed, RuntimeSetupError
from app.gitutil import git
from app.runtimes.materialize import materialize_base
from app.runtimes.patch import patch_from_workspace
from app.runtimes.paths import RuntimePaths
from app.runtimes.sandbox import (
    BRIDGE_SOCKET,
    INIT_PATH,
    INIT_SOURCE,
    Limits,
    Mount,
    Network,
    RunResult,
    bwrap_argv,
    bwrap_available,
    execute,
)
from app.tasksets.schema import InstanceRecord

SANDBOX_HOME = "/home/agent"
_BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _as_record(record: InstanceRecord | dict) -> InstanceRecord:
    return record if isinstance(record, InstanceRecord) else InstanceRecord.model_validate(record)


def _rmtree(path: Path) -> None:
    def onerror(func, p, _exc):  # the agent may have removed write permission somewhere
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            if os.path.isdir(p) and not os.path.islink(p):  # chmod follows a link: to a host file, say
                os.chmod(p, stat.S_IRWXU)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)


class LocalRuntime:
    """A prepared workspace + venv, run under bubblewrap when available (`confined`)."""

    kind = "local"

    def __init__(self, state: dict[str, Any], limits: Limits | None = None):
        self._state = dict(state)
        self.limits = limits or Limits(**state.get("limits", {}))
        self._closed = not Path(state["root"]).exists()

    # --- construction ---------------------------------------------------------------

    @classmethod
    def prepare(
        cls,
        record: InstanceRecord | dict,
        *,
        settings: Settings | None = None,
        paths: RuntimePaths | None = None,
        confine: bool | None = None,
        limits: Limits | None = None,
        gateway_url: str | None = None,
        ro_binds: Sequence[tuple[str | Path, str]] = (),
        purpose: str = "episode",
    ) -> "LocalRuntime":
        """Materialize (cached) base and venv, then a fresh workspace + scratch HOME.

        `confine`: None = use bubblewrap when it works here; True = require it
        (raises `RuntimeSetupError("sandbox")` when missing); False = never.
        `ro_binds`: extra (host path, sandbox path) read-only mounts, e.g. a harness tools folder.
        `gateway_url`: default `settings.gateway_url`.  Raises `RuntimeSetupError` on any setup failure.
        """
        rec = _as_record(record)
        settings = settings or get_settings()
        paths = paths or RuntimePaths.from_settings(settings)
        confined = bwrap_available() if confine is None else confine
        if confined and not bwrap_available():
            raise RuntimeSetupError("sandbox", "bubblewrap (`bwrap`) is required but not usable here; install the Debian package `bubblewrap`")
        t0 = time.monotonic()
        base = materialize_base(rec, paths)
        t1 = time.monotonic()
        env = ensure_env(rec, base, paths, confined=confined)
        t2 = time.monotonic()
        rid = f"{purpose[:5]}-{uuid.uuid4().hex[:12]}"
        root = paths.runtimes / rid
        root.mkdir(parents=True)
        try:
            workspace, home = root / "workspace", root / "home"
            subprocess.run(["cp", "-a", str(base), str(workspace)], check=True)
            apply_overlay(env, workspace)
            home.mkdir()
            (home / ".gitconfig").write_text("[user]\n\tname = agent\n\temail = agent@localhost\n[safe]\n\tdirectory = *\n")
            venv = env.venv if confined else plain_runtime_venv(env, workspace, root / "venv", home)
            base_commit = git(base, "rev-parse", "HEAD", stage="workspace").stdout.strip()
            # What the install left in the tree is ignored like any other by-product:
            # not in the agent's `git status`, not in its patch, kept by `git clean -fd`.
            excludes = root / "overlay.exclude"
            excludes.write_text("".join(f"/{p.relative_to(env.overlay)}\n" for p in env.overlay.rglob("*")
                                        if p.is_file()) if env.overlay.is_dir() else "")
            with open(workspace / ".git" / "info" / "exclude", "a", encoding="utf-8") as fh:
                fh.write(excludes.read_text())
        except BaseException:
            _rmtree(root)
            raise
        t3 = time.monotonic()
        state = {
            "kind": cls.kind, "id": rid, "instance_id": rec.instance_id, "root": str(root),
            "workspace": str(workspace), "home": str(home), "venv": str(venv), "base_repo": str(base),
            "base_commit": base_commit, "env_key": env.key, "python_executable": str(env.python.executable),
            "python_prefix": str(env.python.prefix), "confined": confined,
            "gateway_url": gateway_url or settings.gateway_url,
            "ro_binds": _with_resolved(ro_binds),
            "limits": (limits or Limits.for_episodes(settings)).__dict__,
            "timings": {"base_s": round(t1 - t0, 3), "env_s": round(t2 - t1, 3), "workspace_s": round(t3 - t2, 3)},
        }
        return cls(state, limits or Limits.for_episodes(settings))

    @classmethod
    def attach(cls, state: dict[str, Any]) -> "LocalRuntime":
        """Re-open a runtime from `describe()` output (e.g. in another worker process)."""
        if state.get("kind") != cls.kind:
            raise ValueError(f"not a local runtime state: kind={state.get('kind')!r}")
        return cls(state)

    def describe(self) -> dict[str, Any]:
        """JSON-serializable state (paths, ids, confinement, timings) for `attach` and the episode row."""
        return dict(self._state)

    # --- properties -----------------------------------------------------------------

    id = property(lambda self: self._state["id"])
    instance_id = property(lambda self: self._state["instance_id"])
    root = property(lambda self: Path(self._state["root"]))
    workspace = property(lambda self: Path(self._state["workspace"]), doc="host path of the repository")
    home = property(lambda self: Path(self._state["home"]), doc="host path of the scratch HOME (harness configs go here)")
    confined = property(lambda self: bool(self._state["confined"]))
    base_commit = property(lambda self: self._state["base_commit"])
    timings = property(lambda self: dict(self._state.get("timings", {})))

    @property
    def workdir(self) -> str:
        """The repository's path as commands see it (/testbed when confined)."""
        return SANDBOX_REPO if self.confined else str(self.workspace)

    @property
    def home_dir(self) -> str:
        """HOME as commands see it."""
        return SANDBOX_HOME if self.confined else str(self.home)

    @property
    def gateway_url(self) -> str:
        """The gateway's URL as seen from inside (`network="gateway"` runs,
        `bridge.inside_gateway_url`); unconfined: the configured URL."""
        if not self.confined:
            return self._state["gateway_url"]
        return inside_gateway_url(self._state["gateway_url"])

    # --- running ----------------------------------------------------------------------

    def environment(self, env: dict[str, str] | None = None, path_prepend: Sequence[str] = ()) -> dict[str, str]:
        """The full environment of a command (nothing is inherited from the worker)."""
        venv_bin = f"{SANDBOX_VENV if self.confined else self._state['venv']}/bin"
        out = {
            "PATH": ":".join([*path_prepend, venv_bin, _BASE_PATH]),
            "HOME": self.home_dir, "USER": "agent", "LOGNAME": "agent", "TMPDIR": "/tmp",
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "dumb", "PYTHONUNBUFFERED": "1",
            "VIRTUAL_ENV": SANDBOX_VENV if self.confined else self._state["venv"],
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        }
        out.update(env or {})
        return out

    def run(
        self,
        cmd: str | Sequence[str],
        *,
        env: dict[str, str] | None = None,
        timeout_s: float = 600,
        network: Network = "none",
        stdin: str | bytes | None = None,
        path_prepend: Sequence[str] = (),
        extra_mounts: Sequence[Mount] = (),
        should_stop: Callable[[], bool] | None = None,
    ) -> RunResult:
        """Run `cmd` (a shell string for bash -c, or an argv) in the workspace.

        network: "none" (no network at all) or "gateway" (only the gateway, at
        `self.gateway_url`).  Returns `RunResult`; a timeout gives exit_code 124 and
        timed_out=True (every process of the command is killed); `should_stop()` returning
        True (asked twice a second) kills them at once (`stopped`).  Raises `RuntimeClosed`.
        Unconfined runtimes run directly on the host: no filesystem or network isolation.
        """
        if self._closed:
            raise RuntimeClosed(f"runtime {self.id} is closed")
        if network not in ("none", "gateway"):
            raise ValueError(f"network must be 'none' or 'gateway', not {network!r}")
        argv = ["/bin/bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        full_env = self.environment(env, path_prepend)
        disk = (self.workspace, self.home)  # what `limits.disk_mb` caps
        if not self.confined:
            host_env = dict(full_env)
            return execute(argv, timeout_s=timeout_s, limits=self.limits, confined=False, network=network,
                           env=host_env, cwd=self.workspace, stdin=stdin, should_stop=should_stop, disk_paths=disk)
        mounts = [Mount(self.workspace, SANDBOX_REPO, True), Mount(self.home, SANDBOX_HOME, True),
                  Mount(Path(self._state["venv"]), SANDBOX_VENV, False)]
        mounts += [Mount(Path(h), s, False) for h, s in self._state["ro_binds"]]
        mounts += list(extra_mounts)
        port = None
        socket_path = self.root / "gateway.sock"
        if network == "gateway":
            port = inside_port(self._state["gateway_url"])
            socket_path = _bridge_socket_path(socket_path)
            mounts += [Mount(INIT_SOURCE, INIT_PATH, False), Mount(socket_path, BRIDGE_SOCKET, False)]
        argv = bwrap_argv(argv, mounts=mounts, workdir=SANDBOX_REPO, env=full_env, network=network,
                          python_prefixes=[Path(self._state["python_prefix"])],
                          init_python=self._state["python_executable"], gateway_port=port,
                          tmpfs_mb=self.limits.tmpfs_mb)
        if network != "gateway":
            return execute(argv, timeout_s=timeout_s, limits=self.limits, confined=True, network=network, stdin=stdin,
                           should_stop=should_stop, disk_paths=disk)
        gw = urlsplit(self._state["gateway_url"])
        try:
            with GatewayBridge(socket_path, gw.hostname or "127.0.0.1", gateway_port(self._state["gateway_url"])):
                return execute(argv, timeout_s=timeout_s, limits=self.limits, confined=True, network=network,
                               stdin=stdin, should_stop=should_stop, disk_paths=disk)
        finally:
            if socket_path.parent != self.root:
                shutil.rmtree(socket_path.parent, ignore_errors=True)

    # --- results and cleanup ------------------------------------------------------------

    def patch(self) -> str:
        """The agent's changes as a unified diff against the base commit ("" when none).  Raises `RuntimeClosed`."""
        if self._closed:
            raise RuntimeClosed(f"runtime {self.id} is closed")
        return patch_from_workspace(self.workspace, self.base_commit, base_repo=Path(self._state["base_repo"]),
                                    extra_excludes=self.root / "overlay.exclude")

    def close(self) -> None:
        """Delete the runtime's folder (workspace, home, private venv).  Idempotent."""
        if not self._closed:
            self._closed = True
            if self.root.exists():
                _rmtree(self.root)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "LocalRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LocalRuntime(id={self.id!r}, instance={self.instance_id!r}, confined={self.confined})"




def _with_resolved(binds: Sequence[tuple[str | Path, str]]) -> list[list[str]]:
    """`[host, sandbox]` mounts, plus the resolved target of each host path that goes through a
    symbolic link, mounted at its own path: programs installed under a linked folder (a harness's
    venv under a `var/tools` that links to another disk) name their interpreter by its resolved
    path, which must exist inside the sandbox too."""
    out: list[list[str]] = []
    for host, inside in binds:
        out.append([str(host), inside])
        real = Path(host).resolve()
        if str(real) != str(host) and inside == str(host):
            out.append([str(real), str(real)])
    return out


# A Unix socket's path must fit `sockaddr_un.sun_path`: 108 bytes on Linux, the final NUL
# included (unix(7)); binding a longer one fails with "AF_UNIX path too long".
UNIX_PATH_MAX = 107


def _bridge_socket_path(preferred: Path) -> Path:
    """`preferred` when it fits a Unix socket address, else `gateway.sock` in a new private
    folder (mode 0700) under the system temp folder; the caller removes that folder."""
    if len(os.fsencode(str(preferred))) <= UNIX_PATH_MAX:
        return preferred
    return Path(tempfile.mkdtemp(prefix="turnstile-sock-")) / "gateway.sock"


def cleanup_stale_runtimes(max_age_s: float, *, keep: Sequence[str] = (), settings: Settings | None = None) -> list[str]:
    """Delete runtime folders older than `max_age_s` seconds whose id is not in `keep`.

    For a janitor task: a worker killed mid-episode never reaches `close()`; the
    episode rows that are still live name the runtimes to keep.  Returns the
    removed ids.
    """
    root = RuntimePaths.from_settings(settings).runtimes
    removed: list[str] = []
    if not root.is_dir():
        return removed
    now = time.time()
    for child in root.iterdir():
        if child.is_dir() and child.name not in keep and now - child.stat().st_mtime > max_age_s:
            _rmtree(child)
            removed.append(child.name)
    return removed
