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

import subprocess
import time
from pathlib import Path
from typing import Callable, Sequence

from app.config import Settings, get_settings
from app.runtimes.base import as_record, check_network, shell_argv
from app.runtimes.bridge import inside_port
from app.runtimes.environment import (
    SANDBOX_REPO,
    SANDBOX_VENV,
    apply_overlay,
    ensure_env,
    plain_runtime_venv,
)
from app.runtimes.errors import RuntimeSetupError
from app.gitutil import git
from app.runtimes.images import remove_tree
from app.runtimes.materialize import materialize_base
from app.runtimes.paths import RuntimePaths
from app.runtimes.sandbox import SANDBOX_HOME, Limits, Mount, Network, RunResult, bwrap_argv, bwrap_available, execute
from app.runtimes.workspace import WorkspaceRuntime, make_home, new_runtime_root
from app.tasksets.schema import InstanceRecord

_BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class LocalRuntime(WorkspaceRuntime):
    """A prepared workspace + venv, run under bubblewrap when available (`confined`)."""

    kind = "local"
    excludes_file = "overlay.exclude"  # what the venv install left in the tree

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
        rec = as_record(record)
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
        rid, root = new_runtime_root(paths, purpose)
        try:
            workspace, home = root / "workspace", root / "home"
            subprocess.run(["cp", "-a", str(base), str(workspace)], check=True)
            apply_overlay(env, workspace)
            make_home(home)
            venv = env.venv if confined else plain_runtime_venv(env, workspace, root / "venv", home)
            base_commit = git(base, "rev-parse", "HEAD", stage="workspace").stdout.strip()
            # What the install left in the tree is ignored like any other by-product:
            # not in the agent's `git status`, not in its patch, kept by `git clean -fd`.
            excludes = root / cls.excludes_file
            excludes.write_text("".join(f"/{p.relative_to(env.overlay)}\n" for p in env.overlay.rglob("*")
                                        if p.is_file()) if env.overlay.is_dir() else "")
            with open(workspace / ".git" / "info" / "exclude", "a", encoding="utf-8") as fh:
                fh.write(excludes.read_text())
        except BaseException:
            remove_tree(root)
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

    # --- properties -----------------------------------------------------------------

    @property
    def workdir(self) -> str:
        """The repository's path as commands see it (/testbed when confined)."""
        return SANDBOX_REPO if self.confined else str(self.workspace)

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
        self._check_open()
        check_network(network)
        argv = shell_argv(cmd)
        full_env = self.environment(env, path_prepend)
        disk = (self.workspace, self.home)  # what `limits.disk_mb` caps
        if not self.confined:
            host_env = dict(full_env)
            return execute(argv, timeout_s=timeout_s, limits=self.limits, confined=False, network=network,
                           env=host_env, cwd=self.workspace, stdin=stdin, should_stop=should_stop, disk_paths=disk)
        mounts = [Mount(self.workspace, SANDBOX_REPO, True), Mount(self.home, SANDBOX_HOME, True),
                  Mount(Path(self._state["venv"]), SANDBOX_VENV, False)]
        mounts += self._ro_mounts(self._state["ro_binds"])
        mounts += list(extra_mounts)
        port = inside_port(self._state["gateway_url"]) if network == "gateway" else None
        socket_path, bridge_mounts = self._gateway_socket(network)
        mounts += bridge_mounts
        argv = bwrap_argv(argv, mounts=mounts, workdir=SANDBOX_REPO, env=full_env, network=network,
                          python_prefixes=[Path(self._state["python_prefix"])],
                          init_python=self._state["python_executable"], gateway_port=port,
                          tmpfs_mb=self.limits.tmpfs_mb)
        return self._execute_confined(argv, network=network, socket_path=socket_path, timeout_s=timeout_s,
                                      stdin=stdin, should_stop=should_stop)

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
            remove_tree(child)
            removed.append(child.name)
    return removed
