"""Test images: the SWE-bench-layout fixture image (built once, cached) and a real OCI registry.

`fixture_layout()` builds `scripts/build_fixture_image.sh`'s image once per machine into
`<checkout>/var/cache/images/fixture-<hash of the script>/` (an OCI layout, tag `fixture`; a
few minutes on a fresh machine, then reused: a new script hash builds a new one), under a file
lock so parallel test workers build it once.  `Registry` runs Debian's `docker-registry`
(distribution 2.8) on a free loopback port with a private storage folder, and `push` copies an
image into it with skopeo, as a user's registry would serve it.
"""
from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import time
from pathlib import Path

import httpx

from app.config import ROOT
from support import free_port

BUILDER = ROOT / "scripts" / "build_fixture_image.sh"
TAG = "fixture"


def fixture_layout() -> Path:
    """The fixture image's OCI layout folder (built and cached on first use).  Raises
    RuntimeError with the builder's output when the build fails."""
    key = hashlib.sha256(BUILDER.read_bytes()).hexdigest()[:16]
    cache = ROOT / "var" / "cache" / "images"
    layout = cache / f"fixture-{key}"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"fixture-{key}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (layout / "index.json").is_file():
            staging = cache / f"fixture-{key}.building"
            shutil.rmtree(staging, ignore_errors=True)
            proc = subprocess.run(["bash", str(BUILDER), str(staging), TAG], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{BUILDER.name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            staging.rename(layout)
            for old in cache.glob("fixture-*"):  # builds of older scripts
                if old.is_dir() and old != layout and not old.name.endswith(".building"):
                    shutil.rmtree(old, ignore_errors=True)
    return layout


class Registry:
    """A `docker-registry` process on 127.0.0.1:<port> storing under `folder` (context manager)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Registry":
        exe = shutil.which("docker-registry")
        if exe is None:
            raise RuntimeError("docker-registry is not installed (Debian package docker-registry; "
                               "scripts/system_deps.sh installs it)")
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "config.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.folder / 'data'}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.host}\n")
        self.log = open(self.folder / "registry.log", "wb")
        self.proc = subprocess.Popen([exe, "serve", str(config)], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://{self.host}/v2/", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.__exit__()
        raise RuntimeError(f"docker-registry did not start: {(self.folder / 'registry.log').read_text()[-2000:]}")

    def push(self, source: str, name: str) -> str:
        """Copy image `source` (a skopeo reference, e.g. `oci:<layout>:fixture`) to `name`
        (`repo:tag`) in this registry; returns its `docker://` reference."""
        ref = f"docker://{self.host}/{name}"
        subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", source, ref],
                       check=True, capture_output=True, text=True)
        return ref

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if getattr(self, "log", None):
            self.log.close()


def layer_image(layout: Path, tar_path: Path, tag: str = "tiny", workdir: str = "/", user: str | None = None,
                env: tuple[str, ...] = ()) -> str:
    """An OCI layout at `layout` holding one image `tag` whose only layer is the tarball
    `tar_path` as it is (umoci `raw add-layer` stores it unchecked: how a hostile image ships its
    layer), with the config's WorkingDir, User and Env set; returns its `oci:` reference."""
    if not (layout / "index.json").exists():
        subprocess.run(["umoci", "init", "--layout", str(layout)], check=True, capture_output=True)
    for argv in (["umoci", "new", "--image", f"{layout}:{tag}"],
                 ["umoci", "raw", "add-layer", "--image", f"{layout}:{tag}", str(tar_path)],
                 ["umoci", "config", "--image", f"{layout}:{tag}", "--config.workingdir", workdir,
                  *(["--config.user", user] if user else []), *(a for e in env for a in ("--config.env", e))]):
        subprocess.run(argv, check=True, capture_output=True, text=True)
    return f"oci:{layout}:{tag}"


def tar_of(path: Path, members: list[tuple]) -> Path:
    """Write a tarball at `path` from `(kind, name, arg)` members: ("file", name, text),
    ("dir", name, None), ("symlink", name, target), ("hardlink", name, target), ("chr", name, (major, minor))."""
    import io
    import tarfile

    with tarfile.open(path, "w") as tar:
        for kind, name, arg in members:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            data = None
            if kind == "file":
                data = arg.encode()
                info.size, info.mode = len(data), 0o644
            elif kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, arg
            elif kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, arg
            elif kind == "chr":
                info.type, (info.devmajor, info.devminor), info.mode = tarfile.CHRTYPE, arg, 0o666
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path
