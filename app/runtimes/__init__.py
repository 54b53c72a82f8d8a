"""Runtimes: where an episode's repository lives and its commands run.

`LocalRuntime` (git working copy + cached venv, bubblewrap when installed) and
`OciRuntime` (a task's container image, rootless: skopeo + umoci + bubblewrap) and
`DockerRuntime` (SWE-bench images, where a Docker engine exists).  All are `Runtime`s
(`app.runtimes.base`, whose docstring is the contract a new backend implements):
`prepare(record) → describe()/attach(state) → run(cmd, ...) → patch() → close()`.
"""
from app.runtimes.base import Runtime
from app.runtimes.docker import DockerRuntime, docker_available
from app.runtimes.errors import RuntimeClosed, RuntimeSetupError
from app.runtimes.local import LocalRuntime, cleanup_stale_runtimes
from app.runtimes.materialize import materialize_base
from app.runtimes.oci import OciRuntime
from app.runtimes.patch import PatchError, patch_from_workspace
from app.runtimes.paths import RuntimePaths
from app.runtimes.sandbox import Limits, Mount, RunResult, bwrap_available
from app.runtimes.workspace import WorkspaceRuntime


def attach_runtime(state: dict) -> Runtime:
    """Re-open a runtime from its `describe()` state, whichever kind it is."""
    kinds = {LocalRuntime.kind: LocalRuntime, OciRuntime.kind: OciRuntime, DockerRuntime.kind: DockerRuntime}
    try:
        return kinds[state["kind"]].attach(state)
    except KeyError:
        raise ValueError(f"unknown runtime kind {state.get('kind')!r}") from None


__all__ = [
    "Runtime", "WorkspaceRuntime", "LocalRuntime", "OciRuntime", "DockerRuntime", "docker_available",
    "bwrap_available", "RuntimeSetupError", "RuntimeClosed", "materialize_base", "patch_from_workspace", "PatchError", "RuntimePaths", "Limits",
    "Mount", "RunResult", "attach_runtime", "cleanup_stale_runtimes",
]
