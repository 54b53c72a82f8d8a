"""`Runtime`: the contract every runtime backend implements, and the parts they all share.

A runtime is where one episode's (or one grade's) repository lives and its commands run.  Its
callers: `app.runtimes.choice.prepare_runtime` (prepare), the episode stages in
`app.control.real_stages` (prepare → `describe()` into the READY buffer → `attach_runtime` in the
rollout worker → `run` the harness → `patch` → `close`) and the graders in `app.grading`
(prepare with `purpose="grade"`, `run` the eval script, `close`).

A new backend (a cloud sandbox, say) is one module holding one subclass:

    class CloudRuntime(Runtime):
        kind = "cloud"                      # unique; the "kind" of its `describe()` state
        @classmethod
        def prepare(cls, record, **options) -> "CloudRuntime": ...
        workdir = property(...)             # the repository's path as commands see it
        def run(self, cmd, *, env=None, timeout_s=600, network="none", stdin=None) -> RunResult: ...
        def patch(self) -> str: ...
        def _release(self) -> None: ...     # `close()` calls it once

and one entry in `app.runtimes.attach_runtime` and `choice.prepare_runtime`.  What each must do:

`prepare(record, **options)` (classmethod) → a ready runtime.
    `record`: an `InstanceRecord` or its dict (`as_record` turns either into the model).  The
    repository is at `record.base_commit` (plus the record's bug patch where it has one), the
    instance's environment installed.  `options` are the backend's own keywords (paths, limits,
    mounts, `purpose`: "episode", "oracle" or "grade").  Raises `RuntimeSetupError(stage,
    message)` when anything cannot be set up, after releasing whatever it had acquired; `stage`
    names the step ("image", "sandbox", "install", "docker", ...).

`describe()` → the state: a JSON-serialisable dict with at least "kind" (== `cls.kind`), "id",
    "instance_id", "base_commit" and "confined" (whether commands are isolated from the host).
    `attach(state)` (classmethod) re-opens the runtime from it, in another worker process on the
    same node; it raises `ValueError` for another kind's state.  The base class implements both
    over `self._state`; a backend keeps everything `attach` needs in that dict.

`run(cmd, *, env=None, timeout_s=600, network="none", stdin=None)` → `sandbox.RunResult`.
    `cmd`: a shell string (run as `/bin/bash -c cmd`, `shell_argv`) or an argv; it runs in
    `workdir`.  `env`: variables set on top of the backend's own environment (nothing else is
    inherited from the worker).  `timeout_s`: wall-clock seconds; past it every process of the
    command is killed and the result has exit_code 124 and timed_out=True.  `network`: "none"
    (no network at all) or "gateway" (only the gateway, at the runtime's `gateway_url`);
    `check_network` raises `ValueError` for anything else (a backend that fixes its network at
    prepare, as docker does, may ignore it).  `stdin`: text or bytes fed to the command's
    standard input.  Times in `RunResult` are seconds.  Raises `RuntimeClosed` after `close()`
    (`_check_open`).  The harness rollout also passes `path_prepend` (folders put first on PATH)
    and `should_stop` (asked twice a second; True kills the command, `RunResult.stopped`); the
    local and image runtimes take both.

`patch()` → the agent's changes as a git unified diff (a/ and b/ prefixes, `--binary`, new files
    included, by-products such as caches and egg-info left out) against `base_commit`; "" when
    nothing changed.  It applies nothing: graders apply a patch with `run` (`app.grading.patching`).
    Raises `RuntimeClosed`, `patch.PatchError` (git could not compute the diff),
    `patch.PatchRefused` (the diff adds a symbolic link out of the repository).

`close()` → None.  Idempotent: the first call marks the runtime closed and calls the backend's
    `_release()` (delete folders, stop a container, drop a hold on a shared image); later calls do
    nothing.  `with Backend.prepare(...) as rt:` closes on leaving the block.

Attributes every runtime has: `kind`, `id`, `instance_id`, `base_commit`, `confined`, `timings`
(seconds per prepare step, may be empty), `closed`, `workdir`.  Harness rollouts also read
`home` (host path of the scratch HOME, where harness configs are written), `home_dir` (HOME as
commands see it) and `gateway_url` (the gateway as commands reach it): `WorkspaceRuntime`
(`app.runtimes.workspace`) has them for backends whose repository is a host folder.
"""
from __future__ import annotations

import abc
from typing import Any, ClassVar, Sequence

from app.runtimes.errors import RuntimeClosed
from app.runtimes.sandbox import RunResult
from app.tasksets.schema import InstanceRecord

__all__ = ["Runtime", "as_record", "shell_argv", "check_network", "NETWORKS"]

NETWORKS = ("none", "gateway")  # what `run(network=...)` may ask for


def as_record(record: InstanceRecord | dict) -> InstanceRecord:
    """`record` as an `InstanceRecord` (a dict is validated; pydantic's `ValidationError` if it is not one)."""
    return record if isinstance(record, InstanceRecord) else InstanceRecord.model_validate(record)


def shell_argv(cmd: str | Sequence[str]) -> list[str]:
    """The argv of `run`'s `cmd`: a string runs under `/bin/bash -c`, a sequence is the argv itself."""
    return ["/bin/bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)


def check_network(network: str) -> None:
    """Raises `ValueError` unless `network` is one `run` offers ("none" or "gateway")."""
    if network not in NETWORKS:
        raise ValueError(f"network must be 'none' or 'gateway', not {network!r}")


class Runtime(abc.ABC):
    """One prepared repository and the commands run in it; the module docstring is the contract."""

    kind: ClassVar[str]

    def __init__(self, state: dict[str, Any]):
        self._state = dict(state)
        self._closed = False

    # --- construction ---------------------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def prepare(cls, record: InstanceRecord | dict, **options: Any) -> "Runtime":
        """Set up a fresh runtime for `record`; raises `RuntimeSetupError`."""

    @classmethod
    def attach(cls, state: dict[str, Any]) -> "Runtime":
        """Re-open a runtime from `describe()` output (e.g. in another worker process).
        Raises `ValueError` when `state` is another kind's."""
        if state.get("kind") != cls.kind:
            raise ValueError(f"not {_article(cls.kind)} {cls.kind} runtime state: kind={state.get('kind')!r}")
        return cls(state)

    def describe(self) -> dict[str, Any]:
        """JSON-serializable state for `attach` and the episode row (a copy)."""
        return dict(self._state)

    # --- properties -----------------------------------------------------------------

    id = property(lambda self: self._state["id"])
    instance_id = property(lambda self: self._state["instance_id"])
    base_commit = property(lambda self: self._state["base_commit"])
    confined = property(lambda self: bool(self._state["confined"]), doc="commands are isolated from the host")
    timings = property(lambda self: dict(self._state.get("timings", {})), doc="seconds per prepare step")

    @property
    @abc.abstractmethod
    def workdir(self) -> str:
        """The repository's path as commands see it (their working directory)."""

    @property
    def closed(self) -> bool:
        return self._closed

    # --- running and results ------------------------------------------------------------

    @abc.abstractmethod
    def run(self, cmd: str | Sequence[str], *, env: dict[str, str] | None = None, timeout_s: float = 600,
            network: str = "none", stdin: str | bytes | None = None) -> RunResult:
        """Run `cmd` in `workdir`; raises `RuntimeClosed`, `ValueError` (network)."""

    @abc.abstractmethod
    def patch(self) -> str:
        """The agent's changes as a unified diff against `base_commit`; raises `RuntimeClosed`, `PatchError`."""

    def _check_open(self) -> None:
        """Raises `RuntimeClosed` once `close()` was called."""
        if self._closed:
            raise RuntimeClosed(f"runtime {self.id} is closed")

    # --- cleanup ----------------------------------------------------------------------

    def close(self) -> None:
        """Release the runtime (`_release`) the first time; later calls do nothing."""
        if not self._closed:
            self._closed = True
            self._release()

    @abc.abstractmethod
    def _release(self) -> None:
        """Free everything the runtime holds; `close()` calls it once."""

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, instance={self.instance_id!r})"


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"
