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
import os
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


R2E_RUNNER = """#!/bin/bash
# R2E-Gym's runner stands here in the repository (/testbed/run_tests.sh) and runs the hidden tests
# through the `r2e_tests` link to /r2e_tests, with pytest's -rA summary its parser reads.
source /opt/miniconda3/bin/activate
conda activate testbed
python -m pytest -rA -p no:cacheprovider r2e_tests
"""


def r2e_fixture_layout() -> Path:
    """The fixture image plus one layer in R2E-Gym's layout (built once, cached beside the fixture):
    `/r2e_tests/test_structures.py`, the fixture repository's tests/test_structures.py with the test
    half of tests/fixtures/formats/r2egym.jsonl's commit applied (the hidden tests), and the runner
    `/testbed/run_tests.sh`.  Returns the OCI layout folder (tag `fixture`); it stands in for an
    `r2e-gym/...` per-commit image."""
    import json

    from app.runtimes.images import ImageCache, remove_tree
    from app.runtimes.paths import RuntimePaths
    from app.tasksets.formats.patchtext import r2e_commit_patch

    base = fixture_layout()
    row = json.loads((ROOT / "tests" / "fixtures" / "formats" / "r2egym.jsonl").read_text().splitlines()[0])
    key = hashlib.sha256(b"2" + base.name.encode() + R2E_RUNNER.encode() + row["parsed_commit_content"].encode()).hexdigest()[:12]
    layout = base.parent / f"{base.name}-r2e-{key}"
    with open(base.parent / f"{layout.name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (layout / "index.json").is_file():
            return layout
        work = base.parent / f"{layout.name}.building"
        remove_tree(work)
        work.mkdir()
        try:
            image = ImageCache(paths=RuntimePaths(work / "var", work / "cache")).ensure(f"oci:{base}:{TAG}")
            tests = work / "tests"
            tests.mkdir()
            original = (image.rootfs / "testbed" / "tests" / "test_structures.py").read_text()
            (tests / "test_structures.py").write_text(original)
            patch = r2e_commit_patch(json.loads(row["parsed_commit_content"]), test_files=True)
            # The cache is inside the checkout: stop git finding that repository (it would skip the file).
            subprocess.run(["git", "apply", "-p2", "-"], input=patch, text=True, cwd=tests, check=True,
                           capture_output=True, env={**os.environ, "GIT_CEILING_DIRECTORIES": str(work)})
            if "def test_contains" not in (tests / "test_structures.py").read_text():
                raise RuntimeError("the R2E-Gym fixture's test patch did not apply")
            tar = tar_of(work / "r2e.tar", [
                ("dir", "r2e_tests", None), ("file", "r2e_tests/__init__.py", ""),
                ("file", "r2e_tests/test_structures.py", (tests / "test_structures.py").read_text()),
                ("file", "testbed/run_tests.sh", R2E_RUNNER)])
            staging = work / "layout"
            # Blobs are immutable: links, not copies; index.json is rewritten by umoci, so a copy.
            shutil.copytree(base, staging, copy_function=lambda s, d: os.link(s, d) if "/blobs/" in s else shutil.copy2(s, d))
            subprocess.run(["umoci", "raw", "add-layer", "--image", f"{staging}:{TAG}", str(tar)],
                           check=True, capture_output=True, text=True)
            staging.rename(layout)
        finally:
            remove_tree(work)
    return layout
