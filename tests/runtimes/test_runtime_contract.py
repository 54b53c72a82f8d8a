"""The `Runtime` contract (`app.runtimes.base`): one set of checks every backend passes.

`SubprocessRuntime`, defined here in one class, is the "new backend" the contract promises: it
fills in prepare, workdir, run, patch and _release and nothing else, and passes the same checks
as `LocalRuntime` (confined under bubblewrap, and plain).  The image runtime passes them in its
slow variant (a real registry on loopback, as tests/runtimes/test_oci.py).  `DockerRuntime` is
checked for its shape only: no Docker engine answers here.
"""
from __future__ import annotations

import inspect
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from app.runtimes import (DockerRuntime, LocalRuntime, OciRuntime, Runtime, RuntimeClosed, WorkspaceRuntime,
                          attach_runtime, bwrap_available)
from app.runtimes.base import as_record, check_network, shell_argv
from app.runtimes.patch import patch_from_workspace
from app.runtimes.sandbox import RunResult
from app.tasksets import load_task_set

FILES = {"pkg/__init__.py": "VALUE = 1\n", "README": "a tiny repository\n"}
INLINE = {"instance_id": "demo__pkg-1", "repo": "demo/pkg", "problem_statement": "p", "patch": "x",
          "test_cmd": "true", "FAIL_TO_PASS": ["t::x"], "PASS_TO_PASS": [],
          "source": {"kind": "inline", "name": "pkg", "version": "0.1", "files": FILES}}
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]


class SubprocessRuntime(Runtime):
    """A backend in a temp folder on the host: an inline record's files committed to git, commands
    run by `subprocess` in that folder (no isolation, so `confined` is False)."""

    kind = "subprocess"

    @classmethod
    def prepare(cls, record, *, parent: Path | None = None) -> "SubprocessRuntime":
        rec = as_record(record)
        root = Path(tempfile.mkdtemp(prefix="subproc-", dir=parent))
        workspace = root / "workspace"
        for rel, text in rec.source.files.items():
            (workspace / rel).parent.mkdir(parents=True, exist_ok=True)
            (workspace / rel).write_text(text)
        for argv in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
            subprocess.run([*GIT, *argv], cwd=workspace, check=True, capture_output=True)
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=workspace, capture_output=True, text=True, check=True)
        return cls({"kind": cls.kind, "id": root.name, "instance_id": rec.instance_id, "root": str(root),
                    "workspace": str(workspace), "base_commit": head.stdout.strip(), "confined": False})

    workdir = property(lambda self: self._state["workspace"])

    def run(self, cmd, *, env=None, timeout_s=600, network="none", stdin=None) -> RunResult:
        self._check_open()
        check_network(network)
        full_env = {"PATH": "/usr/bin:/bin", "HOME": self._state["root"], "LANG": "C.UTF-8", **(env or {})}
        t0 = time.monotonic()
        proc = subprocess.Popen(shell_argv(cmd), cwd=self.workdir, env=full_env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        try:
            out, err = proc.communicate(data, timeout=timeout_s)
            code, timed_out = proc.returncode, False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole command, not only its shell
            out, err = proc.communicate()
            code, timed_out = 124, True
        return RunResult(code, out.decode(errors="replace"), err.decode(errors="replace"), timed_out,
                         time.monotonic() - t0, False, network)

    def patch(self) -> str:
        self._check_open()
        return patch_from_workspace(Path(self.workdir), self.base_commit)

    def _release(self) -> None:
        shutil.rmtree(self._state["root"], ignore_errors=True)


def check_contract(prepare, other_kind_state: dict) -> None:
    """The checks of `app.runtimes.base`'s contract on runtimes made by `prepare()` (no arguments)."""
    rt = prepare()
    try:
        assert isinstance(rt, Runtime)
        state = json.loads(json.dumps(rt.describe()))  # JSON-serialisable, as the READY buffer needs
        assert state["kind"] == type(rt).kind and state["id"] == rt.id
        assert {"instance_id", "base_commit", "confined"} <= state.keys()
        rt.describe()["id"] = "changed"
        assert rt.id == state["id"]  # describe() hands out a copy
        with pytest.raises(ValueError, match="runtime state"):
            type(rt).attach(other_kind_state)

        again = type(rt).attach(state)  # as the rollout worker does
        assert type(again) is type(rt) and again.id == rt.id and not again.closed

        hi = again.run("echo hi")
        assert (hi.exit_code, hi.stdout, hi.timed_out, hi.ok) == (0, "hi\n", False, True)
        assert again.run(["/bin/sh", "-c", "exit 3"]).exit_code == 3
        assert again.run('printf %s "$TURNSTILE_PROBE"', env={"TURNSTILE_PROBE": "x y"}).stdout == "x y"
        assert again.run("cat", stdin="fed\n").stdout == "fed\n"
        assert again.run("pwd").stdout.strip() == again.workdir
        slow = again.run("sleep 30", timeout_s=1)
        assert (slow.exit_code, slow.timed_out, slow.ok) == (124, True, False)
        with pytest.raises(ValueError, match="network"):
            again.run("true", network="host")

        assert again.patch() == ""
        assert again.run("echo changed > NEWFILE").ok
        diff = rt.patch()  # the first handle sees what the attached one did
        assert "diff --git a/NEWFILE b/NEWFILE" in diff and "+changed" in diff
    finally:
        rt.close()
    assert rt.closed
    rt.close()  # idempotent
    with pytest.raises(RuntimeClosed):
        rt.run("true")
    with pytest.raises(RuntimeClosed):
        rt.patch()

    with prepare() as scoped:
        assert scoped.run("true").ok
    assert scoped.closed


# --- the new backend and the local runtime pass the same checks ------------------------------------

def test_a_one_class_backend_passes_the_contract(tmp_path):
    check_contract(lambda: SubprocessRuntime.prepare(INLINE, parent=tmp_path), {"kind": "local"})
    assert not any(tmp_path.iterdir())  # close removed every runtime folder


@pytest.mark.parametrize("confine", [pytest.param(True, id="bwrap"), pytest.param(False, id="plain")])
def test_the_local_runtime_passes_the_contract(settings, confine):
    if confine and not bwrap_available():
        pytest.skip("bubblewrap is not usable here")
    record = load_task_set("synthetic").get("synthetic__inflection-1")
    check_contract(lambda: LocalRuntime.prepare(record, settings=settings, confine=confine), {"kind": "oci"})


@pytest.mark.slow
def test_the_image_runtime_passes_the_contract(tmp_path):
    if not bwrap_available():
        pytest.skip("bubblewrap is not usable here")
    from app.config import get_settings
    from app.runtimes.images import ImageCache, remove_tree
    from app.runtimes.paths import RuntimePaths
    from support.registry import Registry, fixture_layout

    try:
        with Registry(tmp_path / "registry") as reg:
            ref = reg.push(f"oci:{fixture_layout()}:fixture", "swe/requests:2.27")
            paths = RuntimePaths(tmp_path / "var", tmp_path / "cache")
            cache = ImageCache(get_settings(), paths)
            record = {"instance_id": "psf__requests-fixture", "repo": "psf/requests", "version": "2.27",
                      "patch": "x", "base_commit": "abcdef1", "test_cmd": "pytest", "problem_statement": "p",
                      "FAIL_TO_PASS": ["t::x"], "PASS_TO_PASS": [], "image": ref}
            check_contract(lambda: OciRuntime.prepare(record, paths=paths, cache=cache), {"kind": "local"})
    finally:
        remove_tree(tmp_path)  # the unpacked image is large


# --- every backend is a Runtime with nothing left abstract -----------------------------------------

@pytest.mark.parametrize("cls", [LocalRuntime, OciRuntime, DockerRuntime, SubprocessRuntime])
def test_every_backend_is_a_complete_runtime(cls):
    assert issubclass(cls, Runtime) and not inspect.isabstract(cls)
    params = inspect.signature(cls.run).parameters
    assert {"env", "timeout_s", "network", "stdin"} <= params.keys()
    assert all(params[p].kind is inspect.Parameter.KEYWORD_ONLY for p in ("env", "timeout_s", "network", "stdin"))


def test_the_host_folder_runtimes_share_one_base_and_attach_by_kind():
    assert issubclass(LocalRuntime, WorkspaceRuntime) and issubclass(OciRuntime, WorkspaceRuntime)
    assert len({LocalRuntime.kind, OciRuntime.kind, DockerRuntime.kind}) == 3
    for attr in ("home", "home_dir", "gateway_url", "workspace", "root"):
        assert isinstance(inspect.getattr_static(WorkspaceRuntime, attr), property)
    with pytest.raises(ValueError, match="unknown runtime kind 'subprocess'"):
        attach_runtime({"kind": "subprocess"})


def test_a_backend_that_leaves_a_method_out_cannot_be_made():
    class NoPatch(Runtime):
        kind = "nopatch"
        workdir = "/"

        @classmethod
        def prepare(cls, record, **options):
            return cls({"kind": cls.kind, "id": "x", "instance_id": "i", "base_commit": "", "confined": False})

        def run(self, cmd, *, env=None, timeout_s=600, network="none", stdin=None):
            raise AssertionError("not reached")

        def _release(self):
            pass

    with pytest.raises(TypeError, match="patch"):
        NoPatch.prepare(INLINE)
