"""`WorkspaceRuntime`: the `Runtime` whose repository is a host folder and whose commands run under bubblewrap.

`LocalRuntime` (a git working copy + cached venv) and `OciRuntime` (a container image's
rootfs) share it: the host layout `<var_dir>/runtimes/<id>/` with `workspace/` (the repository,
read-write inside) and `home/` (the scratch HOME, `SANDBOX_HOME` inside), cgroup and disk caps
(`sandbox.Limits`; `limits.disk_mb` counts workspace and home), `network="gateway"` through a
`GatewayBridge` on the runtime's Unix socket, the patch taken by `patch.patch_from_workspace`,
and `close()` deleting the folder.  A subclass builds the bwrap argv and mounts of its commands
(`run`), names its by-product exclude file (`excludes_file`) and adds to `_release` what else it
holds.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence
from urllib.parse import urlsplit

from app.runtimes.base import Runtime
from app.runtimes.bridge import GatewayBridge, gateway_port, inside_gateway_url
from app.runtimes.patch import patch_from_workspace
from app.runtimes.images import remove_tree
from app.runtimes.paths import RuntimePaths
from app.runtimes.sandbox import (BRIDGE_SOCKET, INIT_PATH, INIT_SOURCE, SANDBOX_HOME, Limits, Mount, RunResult,
                                  execute)

__all__ = ["WorkspaceRuntime", "new_runtime_root", "make_home", "bridge_socket_path", "UNIX_PATH_MAX"]

# A Unix socket's path must fit `sockaddr_un.sun_path`: 108 bytes on Linux, the final NUL
# included (unix(7)); binding a longer one fails with "AF_UNIX path too long".
UNIX_PATH_MAX = 107
AGENT_GITCONFIG = "[user]\n\tname = agent\n\temail = agent@localhost\n[safe]\n\tdirectory = *\n"


def new_runtime_root(paths: RuntimePaths, purpose: str) -> tuple[str, Path]:
    """(id, folder) of a new runtime: id `<first 5 letters of purpose>-<12 hex>`, the folder
    `<var_dir>/runtimes/<id>/` created (its parents too)."""
    rid = f"{purpose[:5]}-{uuid.uuid4().hex[:12]}"
    root = paths.runtimes / rid
    root.mkdir(parents=True)
    return rid, root


def make_home(home: Path) -> None:
    """Create the scratch HOME with a git identity for the agent's commits (`safe.directory = *`:
    the workspace is owned by the worker's uid, not the sandbox's)."""
    home.mkdir()
    (home / ".gitconfig").write_text(AGENT_GITCONFIG)


def bridge_socket_path(preferred: Path) -> Path:
    """`preferred` when it fits a Unix socket address, else `gateway.sock` in a new private
    folder (mode 0700) under the system temp folder; the caller removes that folder."""
    if len(os.fsencode(str(preferred))) <= UNIX_PATH_MAX:
        return preferred
    return Path(tempfile.mkdtemp(prefix="turnstile-sock-")) / "gateway.sock"


class WorkspaceRuntime(Runtime):
    """A runtime folder on this host (state: "root", "workspace", "home", "base_repo", "gateway_url",
    "limits", plus `Runtime`'s keys); the run, mounts and environment are the subclass's."""

    excludes_file: ClassVar[str]  # gitignore-format file under `root`, kept out of `patch()`

    def __init__(self, state: dict[str, Any], limits: Limits | None = None):
        super().__init__(state)
        self.limits = limits or Limits(**state.get("limits", {}))
        self._closed = not Path(state["root"]).exists()

    root = property(lambda self: Path(self._state["root"]))
    workspace = property(lambda self: Path(self._state["workspace"]), doc="host path of the repository")
    home = property(lambda self: Path(self._state["home"]), doc="host path of the scratch HOME (harness configs go here)")

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

    def _gateway_socket(self, network: str) -> tuple[Path, list[Mount]]:
        """(host socket path, mounts the bridge needs inside) for a run on `network`; no mounts
        unless it is "gateway".  A socket path too long for `sun_path` moves to a temp folder."""
        socket_path = self.root / "gateway.sock"
        if network != "gateway":
            return socket_path, []
        socket_path = bridge_socket_path(socket_path)
        return socket_path, [Mount(INIT_SOURCE, INIT_PATH, False), Mount(socket_path, BRIDGE_SOCKET, False)]

    def _execute_confined(self, argv: list[str], *, network: str, socket_path: Path, timeout_s: float,
                          stdin: str | bytes | None, should_stop: Callable[[], bool] | None) -> RunResult:
        """Run a bwrap `argv` under this runtime's limits; for "gateway", with the bridge from
        `socket_path` to the gateway open for the command's lifetime (and its temp folder removed)."""
        disk = (self.workspace, self.home)  # what `limits.disk_mb` caps
        if network != "gateway":
            return execute(argv, timeout_s=timeout_s, limits=self.limits, confined=True, network=network,
                           stdin=stdin, should_stop=should_stop, disk_paths=disk)
        gw = urlsplit(self._state["gateway_url"])
        try:
            with GatewayBridge(socket_path, gw.hostname or "127.0.0.1", gateway_port(self._state["gateway_url"])):
                return execute(argv, timeout_s=timeout_s, limits=self.limits, confined=True, network=network,
                               stdin=stdin, should_stop=should_stop, disk_paths=disk)
        finally:
            if socket_path.parent != self.root:
                shutil.rmtree(socket_path.parent, ignore_errors=True)

    @staticmethod
    def _ro_mounts(binds: Sequence[Sequence[str]]) -> list[Mount]:
        """Read-only mounts of the state's `[host, sandbox]` pairs."""
        return [Mount(Path(h), s, False) for h, s in binds]

    # --- results and cleanup ------------------------------------------------------------

    def patch(self) -> str:
        """The agent's changes as a unified diff against the base commit ("" when none).
        Raises `RuntimeClosed`, `PatchError`, `PatchRefused`."""
        self._check_open()
        return patch_from_workspace(self.workspace, self.base_commit, base_repo=Path(self._state["base_repo"]),
                                    extra_excludes=self.root / self.excludes_file)

    def _release(self) -> None:
        """Delete the runtime's folder (workspace, home and whatever else it holds)."""
        if self.root.exists():
            remove_tree(self.root)
