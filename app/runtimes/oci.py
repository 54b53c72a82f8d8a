"""`OciRuntime`: an episode (or a grade) inside its task's container image, rootless, no daemon.

    rt = OciRuntime.prepare(record, image="docker://127.0.0.1:5000/swe/requests:2.27")
    state = rt.describe()                        # JSON, like LocalRuntime's
    rt = OciRuntime.attach(state)
    rt.run("python -m pytest -x", timeout_s=600, network="gateway")
    patch = rt.patch()
    rt.close()

The image is pulled with skopeo and unpacked once per node by `app.runtimes.images` (a cache
keyed by manifest digest, shared read-only by every runtime of that image).  Each runtime gets:

* its own copy of the repository folder (`record.repo_dir`, default /testbed, else the image's
  WorkingDir), bound read-write over the shared rootfs;
* a scratch HOME at /home/agent;
* when the record has a `bug_patch` (SWE-smith rows), that patch applied and committed on top
  of the image's repository (`oci_repo.commit_bug_patch`), in the episode's and the grade's
  runtime alike: the agent's patch is taken against the bug commit;
* outside a grade, the record's `hidden_paths` left out (R2E-Gym's hidden tests and runner:
  absent from the episode's root and repository copy, present in a grade runtime);
* the host programs it was given read-only at fixed paths (`ro_binds`: a harness's tools folder,
  the Python its venv points to, Node), checked against the image's C library first
  (`rootfs.libc_check`: a musl image or one with an older glibc is refused, naming the image).

Commands run under bubblewrap as in `app.runtimes.sandbox` (fresh namespaces, every capability
dropped, cgroup caps, `network="gateway"` reaching only the gateway through the bridged Unix
socket), over a tmpfs root rebuilt from the image's rootfs (`oci_sandbox.image_bwrap_argv`),
with the image config's Env, WorkingDir and User.  The image's conda-style env `testbed`
(/opt/miniconda3/envs/testbed, as SWE-bench images have it) is first on PATH when present.

Host layout `<var_dir>/runtimes/<id>/`: `workspace/` (the repository copy), `home/`,
`base/` (the private trusted repository: the image's objects borrowed, or a snapshot when the
image's folder has no git history; `app.runtimes.oci_repo`),
`untracked.exclude` (files untracked in the image, kept out of patches), `gateway.sock`.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Sequence

from app.config import Settings, get_settings
from app.runtimes.base import as_record, check_network, shell_argv
from app.runtimes.bridge import inside_port
from app.runtimes.errors import RuntimeSetupError
from app.runtimes.images import Image, ImageCache, remove_tree
from app.runtimes.oci_repo import (DEFAULT_REPO_DIR, commit_bug_patch, hide_in_workspace, own_git_dir, record_extra,
                                   repo_dir, repository_facts)
from app.runtimes.oci_sandbox import SANDBOX_HOME, TESTBED_ENV, image_bwrap_argv, image_environment
from app.runtimes.paths import RuntimePaths
from app.runtimes.rootfs import libc_check, resolve_inside
from app.runtimes.sandbox import Limits, Mount, Network, RunResult, bwrap_available
from app.runtimes.workspace import WorkspaceRuntime, make_home, new_runtime_root
from app.tasksets.schema import InstanceRecord

__all__ = ["OciRuntime", "host_python", "harness_check", "DEFAULT_REPO_DIR", "SANDBOX_HOME", "TESTBED_ENV"]


def host_python() -> tuple[Path, Path]:
    """(executable, prefix) of the Python this worker runs on: it starts the sandbox's gateway
    listener, mounted at its own path.  Raises `RuntimeSetupError("sandbox")` when it lives under
    /usr (the image's /usr takes that place)."""
    prefix = Path(sys.base_prefix).resolve()
    exe = prefix / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    if str(prefix).startswith("/usr"):
        raise RuntimeSetupError("sandbox", f"the worker's Python ({prefix}) is under /usr, which an image replaces; "
                                           "run Turnstile on a Python outside /usr (pyenv, a standalone build)")
    return exe, prefix


class OciRuntime(WorkspaceRuntime):
    """A runtime whose root filesystem is a container image (state: image digest, workspace, ...)."""

    kind = "oci"
    excludes_file = "untracked.exclude"  # files untracked in the image

    # --- construction ---------------------------------------------------------------

    @classmethod
    def prepare(
        cls,
        record: InstanceRecord | dict,
        *,
        image: str | None = None,
        settings: Settings | None = None,
        paths: RuntimePaths | None = None,
        limits: Limits | None = None,
        gateway_url: str | None = None,
        ro_binds: Sequence[tuple[str | Path, str]] = (),
        programs: Sequence[str | Path] = (),
        harness: str | None = None,
        purpose: str = "episode",
        cache: ImageCache | None = None,
    ) -> "OciRuntime":
        """Pull and unpack the image (cached per node), then a fresh repository copy and HOME.

        `image`: a reference (`app.runtimes.images.parse_reference`); default `record.image`.
        `ro_binds`: (host path, sandbox path) read-only mounts (harness tools, Node, Python).
        `purpose`: "episode", "oracle" or "grade"; only a grade runtime sees `hidden_paths`.
        `programs`: host executables among them that must run on the image's C library
        (`harness` names them in the error).  Raises `RuntimeSetupError`: stage "image" (pull or
        unpack failed: skopeo's or the registry's answer), "image cache", "repository" (the
        repository folder is not in the image), "bug_patch" (the record's bug patch does not
        apply to the image's repository), "harness" (the harness cannot run in this image),
        "sandbox" (no usable bubblewrap).
        """
        rec = as_record(record)
        settings = settings or get_settings()
        paths = paths or RuntimePaths.from_settings(settings)
        ref = image or rec.image
        if not ref:
            raise RuntimeSetupError("image", f"instance {rec.instance_id} names no image")
        if not bwrap_available():
            raise RuntimeSetupError("sandbox", "bubblewrap (`bwrap`) is required for image runtimes; "
                                               "install the Debian package `bubblewrap`")
        t0 = time.monotonic()
        rid, root = new_runtime_root(paths, purpose)
        cache = cache or ImageCache(settings, paths)
        try:
            img = cache.ensure(ref, user=rid, user_root=root)
            t1 = time.monotonic()
            if programs:
                why = harness_check(img, programs)
                if why:
                    raise RuntimeSetupError("harness", f"{harness or 'the harness'} cannot run in image {ref}: {why}")
            folder = repo_dir(rec, img)
            base = resolve_inside(img.rootfs, folder)
            if base is None or not base.is_dir() or base == img.rootfs:
                raise RuntimeSetupError("repository", f"image {ref} has no folder {folder} "
                                                      f"(instance {rec.instance_id}'s repository)")
            workspace, home = root / "workspace", root / "home"
            subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(workspace)], check=True, capture_output=True)
            make_home(home)
            base_repo, base_commit, untracked = repository_facts(img, folder, base, root)
            own_git_dir(workspace, img.rootfs, folder)
            if rec.bug_patch:
                base_repo, base_commit = commit_bug_patch(rec.bug_patch, base_repo, base_commit, workspace, root,
                                                          rec.instance_id)
            hidden = [str(h) for h in record_extra(rec, "hidden_paths") or []] if purpose != "grade" else []
            hide_in_workspace(workspace, folder, hidden)
            (root / cls.excludes_file).write_text(untracked)
            exe, prefix = host_python()
        except BaseException:
            cache.release(_digest_or_empty(locals().get("img")), rid)
            remove_tree(root)
            raise
        t2 = time.monotonic()
        state = {
            "kind": cls.kind, "id": rid, "instance_id": rec.instance_id, "root": str(root),
            "workspace": str(workspace), "home": str(home), "image": ref, "digest": img.digest,
            "bundle": str(img.bundle), "repo_dir": folder, "hidden": hidden, "base_repo": str(base_repo),
            "base_commit": base_commit, "image_env": img.config.env, "image_cwd": img.config.cwd,
            "uid": img.config.uid, "gid": img.config.gid, "cache_root": str(cache.root),
            "python_executable": str(exe), "python_prefix": str(prefix), "confined": True,
            "gateway_url": gateway_url or settings.gateway_url,
            "ro_binds": [[str(h), s] for h, s in ro_binds],
            "limits": (limits or Limits.for_episodes(settings)).__dict__,
            "timings": {"image_s": round(t1 - t0, 3), "workspace_s": round(t2 - t1, 3)},
        }
        return cls(state, limits or Limits.for_episodes(settings))

    # --- properties -----------------------------------------------------------------

    image = property(lambda self: self._state["image"])
    digest = property(lambda self: self._state["digest"])
    rootfs = property(lambda self: Path(self._state["bundle"]) / "rootfs")
    workdir = property(lambda self: self._state["repo_dir"], doc="the repository's path inside")

    # --- running ----------------------------------------------------------------------

    def environment(self, env: dict[str, str] | None = None, path_prepend: Sequence[str] = ()) -> dict[str, str]:
        """The full environment of a command (`oci_sandbox.image_environment`)."""
        return image_environment(self.rootfs, self._state["image_env"], env, path_prepend)

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
        workdir: str | None = None,
    ) -> RunResult:
        """Run `cmd` (a shell string for the image's /bin/bash -c, or an argv) in the repository.

        Same contract as `LocalRuntime.run`: network "none" or "gateway"; exit 124 + timed_out on
        timeout; `should_stop` kills at once.  `extra_mounts` (e.g. a grade's test files) are
        mounted after the image.  Raises `RuntimeClosed`.
        """
        self._check_open()
        check_network(network)
        argv = shell_argv(cmd)
        repo = self._state["repo_dir"]
        mounts = [Mount(self.workspace, repo, True), Mount(self.home, SANDBOX_HOME, True)]
        mounts += self._ro_mounts(self._state["ro_binds"])
        prefix = Path(self._state["python_prefix"])
        if network == "gateway":
            mounts.append(Mount(prefix, str(prefix), False))
        mounts += list(extra_mounts)
        socket_path, bridge_mounts = self._gateway_socket(network)
        mounts += bridge_mounts
        full = self._bwrap(argv, mounts, workdir or repo, self.environment(env, path_prepend), network)
        return self._execute_confined(full, network=network, socket_path=socket_path, timeout_s=timeout_s,
                                      stdin=stdin, should_stop=should_stop)

    def _bwrap(self, command: list[str], mounts: list[Mount], workdir: str, env: dict[str, str],
               network: str) -> list[str]:
        gateway = (self._state["python_executable"], inside_port(self._state["gateway_url"])) if network == "gateway" else None
        return image_bwrap_argv(command, rootfs=self.rootfs, mounts=mounts, workdir=workdir, env=env,
                                uid=self._state["uid"], gid=self._state["gid"], tmpfs_mb=self.limits.tmpfs_mb,
                                hidden=self._state.get("hidden", []), gateway=gateway)

    # --- cleanup ----------------------------------------------------------------------

    def _release(self) -> None:
        """Delete the runtime's folder and drop its hold on the shared image."""
        super()._release()
        (Path(self._state["cache_root"]) / "rootfs" / self.digest.split(":", 1)[-1] / "users" / self.id
         ).unlink(missing_ok=True)

    def __repr__(self) -> str:
        return f"OciRuntime(id={self.id!r}, image={self.image!r}, instance={self.instance_id!r})"


def harness_check(img: Image, programs: Sequence[str | Path]) -> str | None:
    """Why the host `programs` (a harness's mounted executables) cannot run in `img`, or None:
    `rootfs.libc_check`, remembered in the image's bundle per program file (path, size, mtime)."""
    return _checked(img, [Path(p) for p in programs])


def _checked(img: Image, programs: list[Path]) -> str | None:
    """`libc_check` of `programs` on `img`, remembered in the image's bundle per program file
    (path, size, mtime): reading a 100 MB `node` and running `ldd` costs about a second, a
    warm prepare must not."""
    stats = [(str(p), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in programs]
    key = hashlib.sha256(repr(stats).encode()).hexdigest()[:24]
    memo = img.bundle / "checks" / key
    try:
        text = memo.read_text()
        return text or None
    except OSError:
        pass
    why = libc_check(img.rootfs, programs)
    memo.parent.mkdir(exist_ok=True)
    tmp = memo.with_suffix(f".{uuid.uuid4().hex[:8]}")
    tmp.write_text(why or "")
    os.replace(tmp, memo)
    return why


def _digest_or_empty(img: Image | None) -> str:
    return img.digest if img is not None else "sha256:none"
