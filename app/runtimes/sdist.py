"""Fetch a PyPI sdist (sha256-checked, cached by hash) and unpack it.

Lookup uses the JSON form of PyPI's Simple API (PEP 691,
https://peps.python.org/pep-0691/): `GET <index>/<name>/` with
`Accept: application/vnd.pypi.simple.v1+json` lists every file with its
SHA-256, so the archive is chosen *by its hash*.  If that fails, `pip download
--no-deps --no-binary :all:` (pip's ordinary client; slower, it builds
metadata) is the fallback.  Either way the archive's SHA-256 must equal
`source.sha256` or the download is refused.
"""
from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import httpx

from app.config import get_settings
from app.runtimes.errors import RuntimeSetupError
from app.runtimes.paths import RuntimePaths, build_lock
from app.tasksets.schema import PypiSdistSource

SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"


def _index_url() -> str:
    return (get_settings().pip_index_url or "https://pypi.org/simple").rstrip("/")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503 normalized project name


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_simple(source: PypiSdistSource, dest_dir: Path) -> Path:
    url = f"{_index_url()}/{_normalize(source.name)}/"
    with httpx.Client(timeout=60, follow_redirects=True) as client:
        resp = client.get(url, headers={"Accept": SIMPLE_JSON})
        resp.raise_for_status()
        files = resp.json()["files"]
        match = [f for f in files if f.get("hashes", {}).get("sha256") == source.sha256]
        if not match:
            raise RuntimeSetupError("download", f"{url} lists no file with sha256 {source.sha256}")
        target = dest_dir / match[0]["filename"]
        with client.stream("GET", match[0]["url"]) as r, open(target, "wb") as out:
            r.raise_for_status()
            for chunk in r.iter_bytes():
                out.write(chunk)
    return target


def _download_pip(source: PypiSdistSource, dest_dir: Path) -> Path:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
         "-d", str(dest_dir), f"{source.name}=={source.version}"],
        capture_output=True, text=True, timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeSetupError("download", f"pip download {source.name}=={source.version} failed: {proc.stderr[-2000:]}")
    found = [p for p in dest_dir.iterdir() if p.is_file()]
    if len(found) != 1:
        raise RuntimeSetupError("download", f"pip download left {len(found)} files, expected one archive")
    return found[0]


def fetch_sdist(source: PypiSdistSource, paths: RuntimePaths) -> Path:
    """Path of the cached archive `<cache>/sdists/<sha256>/<filename>`, downloading it once.

    Raises `RuntimeSetupError("download"|"sha256", ...)` when it cannot be fetched or its hash differs.
    """
    slot = paths.sdists / source.sha256
    with build_lock(paths.sdists / f".{source.sha256}.lock"):
        if slot.is_dir():
            cached = [p for p in slot.iterdir() if p.is_file()]
            if cached and sha256_of(cached[0]) == source.sha256:
                return cached[0]
            shutil.rmtree(slot)
        paths.sdists.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".dl-", dir=paths.sdists))
        try:
            try:
                archive = _download_simple(source, tmp)
            except (httpx.HTTPError, KeyError, ValueError, RuntimeSetupError):
                for p in tmp.iterdir():
                    p.unlink()
                archive = _download_pip(source, tmp)
            got = sha256_of(archive)
            if got != source.sha256:
                raise RuntimeSetupError("sha256", f"{archive.name}: sha256 {got} != expected {source.sha256}; refusing it")
            tmp.rename(slot)
            return slot / archive.name
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def unpack_sdist(archive: Path, dest: Path) -> None:
    """Unpack `archive` so that its single top-level folder's *contents* become `dest` (must not exist).

    tar archives use the `data` extraction filter (no absolute paths, links out of
    the tree or device files; executable bits are kept, which the commit id needs).
    """
    staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest.parent))
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                for info in zf.infolist():
                    if info.filename.startswith("/") or ".." in Path(info.filename).parts:
                        raise RuntimeSetupError("unpack", f"unsafe member {info.filename!r} in {archive.name}")
                zf.extractall(staging)
        else:
            with tarfile.open(archive) as tf:
                tf.extractall(staging, filter="data")
        tops = list(staging.iterdir())
        if len(tops) != 1 or not tops[0].is_dir():
            raise RuntimeSetupError("unpack", f"{archive.name} must hold exactly one top-level folder, found {len(tops)}")
        tops[0].rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
