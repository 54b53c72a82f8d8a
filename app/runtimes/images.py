"""The node's image cache: pull an image with skopeo, unpack it once with umoci, share it read-only.

Host layout under `<cache_dir>/images/`:

  refs/<key>.json          a reference resolved once per node: {"ref", "digest"} (the manifest digest)
  layouts/<key>/           the OCI layout `skopeo copy` wrote (removed once unpacked)
  rootfs/<hex>/            one image by manifest digest: `umoci unpack --rootless` output
                           (rootfs/, config.json = the OCI runtime config with the image's Env, Cwd
                           and User), plus `size` (bytes), `last_used` (its mtime orders eviction)
                           and users/<runtime id> (one file per runtime using it; its content is
                           that runtime's folder, so a runtime that vanished without `close()` no
                           longer holds the image)
  locks/                   fcntl locks: one per reference (pull) and one per digest (unpack)

References (`parse_reference`): `docker://host[:port]/name:tag` (a registry; loopback registries
are pulled with `--src-tls-verify=false`), `docker-archive:/path.tar[:name:tag]` (a `docker save`
tarball), `oci:/path/layout[:tag]` (an OCI layout), `oci-archive:/path.tar[:tag]`, or a bare
`name[:tag]` (= `docker://name:tag`, Docker Hub for unqualified names).  Tools: Debian 12's
`skopeo` 1.9 and `umoci` 0.4.7 (https://github.com/opencontainers/umoci, `unpack --rootless`:
files owned by the caller, no device nodes, layer paths confined to the rootfs with
filepath-securejoin).

A tag is resolved to its digest once per node and then pinned (`refs/`): warm prepares never
ask the registry (that is what keeps them under 0.1 s), and every episode of a run sees the
same image.  Remove `refs/<key>.json` (or the whole cache) to re-resolve a moved tag.

The cache never holds more than `TURNSTILE_IMAGE_CACHE_BYTES` once an unpack ends: least
recently used images that no runtime uses are removed; an image that cannot fit even then is
removed again and the prepare fails with `RuntimeSetupError("image cache")`.

`pull_image` is the same pull and unpack for a node's operator (`turnstile images pull`, `tasks
prefetch`), reporting each stage to a callback; `ImageCache.listing()` is what the cache holds.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from app.config import Settings, get_settings
from app.runtimes.errors import RuntimeSetupError
from app.runtimes.paths import RuntimePaths
from app.runtimes.sandbox import disk_usage_bytes

LOOPBACK = ("127.0.0.1", "localhost", "[::1]")
TAG = "img"  # the tag every pulled layout holds its one image under


@dataclass(frozen=True)
class Reference:
    """A parsed image reference: `transport` (docker | docker-archive | oci | oci-archive), the
    `source` argument for skopeo, and the cache `key` (a hash of the reference, plus size and
    mtime for local files so a rewritten tarball is resolved again)."""

    text: str
    transport: str
    source: str
    key: str
    loopback: bool = False


def parse_reference(ref: str) -> Reference:
    """Parse `ref` (see the module docstring).  Raises `RuntimeSetupError("image")` on an empty
    reference or a local file/layout that does not exist."""
    ref = ref.strip()
    if not ref:
        raise RuntimeSetupError("image", "empty image reference")
    for transport in ("docker-archive", "oci-archive", "oci"):
        if ref.startswith(transport + ":"):
            rest = ref[len(transport) + 1:]
            path = rest.split(":", 1)[0]
            p = Path(path)
            if not p.exists():
                raise RuntimeSetupError("image", f"{ref}: no such {'layout' if transport == 'oci' else 'file'} {path}")
            if transport == "oci" and ":" not in rest:
                rest += ":latest"
            st = (p / "index.json").stat() if p.is_dir() else p.stat()
            key = _hash(f"{transport}:{p.resolve()}{rest[len(path):]}:{st.st_size}:{st.st_mtime_ns}")
            return Reference(ref, transport, f"{transport}:{p.resolve()}{rest[len(path):]}", key)
    name = ref.removeprefix("docker://").lstrip("/")
    last = name.rsplit("/", 1)[-1]
    if ":" not in last and "@" not in last:
        name += ":latest"
    host = name.split("/", 1)[0] if "/" in name else ""
    loopback = host.split(":")[0] in ("127.0.0.1", "localhost") or host.startswith("[::1]")
    return Reference(ref, "docker", f"docker://{name}", _hash(f"docker://{name}"), loopback)


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ImageConfig:
    """What the image's config sets for its processes: `env` (NAME -> value, in order), `cwd`
    (absolute path inside), `uid`/`gid` (numbers; umoci resolves the image's `User` against
    its own /etc/passwd)."""

    env: dict[str, str]
    cwd: str
    uid: int
    gid: int


@dataclass(frozen=True)
class Image:
    """One unpacked image: `digest` (sha256:<hex> of the manifest), `bundle` (host folder),
    `rootfs` (bundle/rootfs), `config`, `size_bytes` (disk used by the bundle)."""

    ref: str
    digest: str
    bundle: Path
    config: ImageConfig
    size_bytes: int

    @property
    def rootfs(self) -> Path:
        return self.bundle / "rootfs"


def read_config(bundle: Path) -> ImageConfig:
    """Parse umoci's `config.json` (an OCI runtime spec, https://github.com/opencontainers/runtime-spec)."""
    spec = json.loads((bundle / "config.json").read_text())
    process = spec.get("process") or {}
    env: dict[str, str] = {}
    for item in process.get("env") or []:
        name, _, value = item.partition("=")
        if name:
            env[name] = value
    user = process.get("user") or {}
    cwd = process.get("cwd") or "/"
    return ImageConfig(env, cwd if cwd.startswith("/") else "/" + cwd, int(user.get("uid", 0)), int(user.get("gid", 0)))


class ImageCache:
    """The node's cache of unpacked images (see the module docstring).  Safe across processes."""

    def __init__(self, settings: Settings | None = None, paths: RuntimePaths | None = None,
                 cap_bytes: int | None = None):
        self.settings = settings or get_settings()
        paths = paths or RuntimePaths.from_settings(self.settings)
        self.root = paths.cache_dir / "images"
        self.cap_bytes = cap_bytes if cap_bytes is not None else self.settings.image_cache_bytes
        for sub in ("refs", "layouts", "rootfs", "locks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    # --- locks ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        with open(self.root / "locks" / f"{name}.lock", "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    # --- the one public entry -------------------------------------------------------------

    def ensure(self, ref: str, user: str | None = None, user_root: Path | None = None,
               on_stage: Callable[[str], None] | None = None) -> Image:
        """The image `ref` unpacked on this node: from the cache when there (no registry call),
        else pulled and unpacked once, however many processes ask at the same time.

        `user` (a runtime id) and `user_root` (its folder) register a user: the image is not
        evicted while that folder exists, until `release(digest, user)`.  Raises
        `RuntimeSetupError("image")` with skopeo's or umoci's own message when the pull or
        unpack fails (a missing image or tag gives the registry's answer), and
        `RuntimeSetupError("image cache")` when the image cannot fit the cache.  `on_stage` is
        told "resolving", then "pulling" and "unpacking" only when the node lacks the image.
        """
        stage = on_stage or (lambda _name: None)
        stage("resolving")
        reference = parse_reference(ref)
        ref_file = self.root / "refs" / f"{reference.key}.json"
        digest = _read_digest(ref_file)
        if digest is not None and (image := self._hit(ref, digest, user, user_root)) is not None:
            return image
        with self._lock("ref-" + reference.key):
            digest = _read_digest(ref_file)
            if digest is None or not self._complete(digest):
                try:
                    stage("pulling")
                    digest = self._pull(reference)
                    stage("unpacking")
                    self._unpack(reference, digest)
                finally:  # the pulled layout is only needed to unpack; a failed pull leaves nothing
                    remove_tree(self.root / "layouts" / reference.key)
                tmp = ref_file.with_suffix(f".{uuid.uuid4().hex[:8]}.tmp")
                tmp.write_text(json.dumps({"ref": ref, "digest": digest}))
                os.replace(tmp, ref_file)
        image = self._hit(ref, digest, user, user_root)
        if image is None:  # evicted between the unpack and now: only under a cap smaller than one image
            raise RuntimeSetupError("image cache", f"{ref} was evicted right after unpacking; "
                                                   f"TURNSTILE_IMAGE_CACHE_BYTES={self.cap_bytes} is too small")
        return image

    def cached(self, ref: str) -> Image | None:
        """The image `ref` when this node has it unpacked already, else None; never pulls, asks no
        registry, registers no user (for checks before a run starts, `app.control.preflight`)."""
        try:
            reference = parse_reference(ref)
        except RuntimeSetupError:
            return None
        digest = _read_digest(self.root / "refs" / f"{reference.key}.json")
        if digest is None:
            return None
        bundle = self._bundle(digest)
        try:
            return Image(ref, digest, bundle, read_config(bundle), int((bundle / "size").read_text()))
        except (OSError, ValueError):
            return None

    def release(self, digest: str, user: str) -> None:
        """Drop `user`'s hold on the image `digest` (idempotent)."""
        (self._bundle(digest) / "users" / user).unlink(missing_ok=True)

    # --- pull and unpack --------------------------------------------------------------------

    def _pull(self, reference: Reference) -> str:
        layout = self.root / "layouts" / reference.key
        shutil.rmtree(layout, ignore_errors=True)
        layout.mkdir(parents=True)
        digest_file = layout.parent / f"{reference.key}.digest"
        argv = ["skopeo", "copy", "--quiet", "--digestfile", str(digest_file)]
        if reference.transport == "docker" and (reference.loopback or not self.settings.image_tls_verify):
            argv.append("--src-tls-verify=false")
        argv += [reference.source, f"oci:{layout}:{TAG}"]
        self._tool(argv, f"pull {reference.text}")
        digest = digest_file.read_text().strip()
        digest_file.unlink(missing_ok=True)
        if not digest.startswith("sha256:"):
            raise RuntimeSetupError("image", f"pull {reference.text}: skopeo wrote no manifest digest ({digest!r})")
        return digest

    def _unpack(self, reference: Reference, digest: str) -> None:
        with self._lock("digest-" + digest.split(":", 1)[1][:32]):
            if self._complete(digest):
                return
            layout = self.root / "layouts" / reference.key
            estimate = 3 * disk_usage_bytes([layout / "blobs"])  # compressed layers expand ~2-3x
            self._evict(estimate)
            bundle = self._bundle(digest)
            staging = bundle.with_name(f"{bundle.name}.unpack-{uuid.uuid4().hex[:8]}")
            try:
                self._tool(["umoci", "unpack", "--rootless", "--image", f"{layout}:{TAG}", str(staging)],
                           f"unpack {reference.text}")
                read_config(staging)  # a config we cannot read fails here, not in every episode
                size = disk_usage_bytes([staging])
                (staging / "users").mkdir()
                (staging / "size").write_text(str(size))
                (staging / "last_used").touch()
                shutil.rmtree(bundle, ignore_errors=True)
                os.rename(staging, bundle)
            except BaseException:
                remove_tree(staging)
                raise
            self._evict(0, keep=digest)
            if self.total_bytes() > self.cap_bytes:
                remove_tree(bundle)
                raise RuntimeSetupError("image cache", f"{reference.text} needs {size} bytes unpacked; with the images "
                                                       f"in use the cache cannot stay under TURNSTILE_IMAGE_CACHE_BYTES="
                                                       f"{self.cap_bytes}")

    def _tool(self, argv: list[str], what: str) -> None:
        exe = shutil.which(argv[0])
        if exe is None:
            pkg = {"skopeo": "skopeo", "umoci": "umoci"}[argv[0]]
            raise RuntimeSetupError("image", f"{what}: `{argv[0]}` is not installed (Debian package {pkg})")
        try:
            proc = subprocess.run([exe, *argv[1:]], capture_output=True, text=True,
                                  timeout=self.settings.image_pull_timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise RuntimeSetupError("image", f"{what}: {argv[0]} took longer than "
                                             f"{self.settings.image_pull_timeout_s} s (TURNSTILE_IMAGE_PULL_TIMEOUT_S)") from None
        if proc.returncode != 0:
            text = (proc.stderr or proc.stdout).strip()
            # skopeo logs its error as logrus does (`time="…" level=fatal msg="…"`): keep its message.
            if found := re.search(r'level=fatal msg="((?:[^"\\]|\\.)*)"', text):
                with contextlib.suppress(ValueError):
                    text = json.loads(f'"{found.group(1)}"')
            raise RuntimeSetupError("image", f"{what}: {argv[0]} exited {proc.returncode}: {text[-2000:]}")

    # --- the cache itself -------------------------------------------------------------------

    def _bundle(self, digest: str) -> Path:
        return self.root / "rootfs" / digest.split(":", 1)[-1]

    def _complete(self, digest: str) -> bool:
        return (self._bundle(digest) / "size").is_file()

    def _hit(self, ref: str, digest: str, user: str | None, user_root: Path | None) -> Image | None:
        bundle = self._bundle(digest)
        try:
            size = int((bundle / "size").read_text())
            if user is not None:
                (bundle / "users" / user).write_text(str(user_root or ""))
            os.utime(bundle / "last_used")
        except (OSError, ValueError):
            return None
        return Image(ref, digest, bundle, read_config(bundle), size)

    def entries(self) -> list[tuple[str, int, float, bool]]:
        """(digest, size in bytes, last use as a Unix time, in use) of every complete image."""
        out = []
        for bundle in (self.root / "rootfs").iterdir():
            try:
                size = int((bundle / "size").read_text())
                last = (bundle / "last_used").stat().st_mtime
            except (OSError, ValueError):
                continue
            out.append(("sha256:" + bundle.name, size, last, _in_use(bundle)))
        return out

    def listing(self) -> list[CachedImage]:
        """Every complete image, most recently used first, with the references pinned to it."""
        refs: dict[str, list[str]] = {}
        for ref_file in sorted((self.root / "refs").glob("*.json")):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                pin = json.loads(ref_file.read_text())
                refs.setdefault(pin["digest"], []).append(pin["ref"])
        return sorted((CachedImage(d, tuple(refs.get(d, ())), size, last, busy) for d, size, last, busy in self.entries()),
                      key=lambda c: -c.last_used)

    def total_bytes(self) -> int:
        return sum(size for _d, size, _t, _u in self.entries())

    def _evict(self, incoming: int, keep: str | None = None) -> list[str]:
        """Remove least recently used images not in use until the cache plus `incoming` bytes fits
        the cap; returns the removed digests.  Runs under a cache-wide lock."""
        removed: list[str] = []
        with self._lock("evict"):
            self._sweep_staging()
            entries = sorted(self.entries(), key=lambda e: e[2])
            total = sum(e[1] for e in entries)
            for digest, size, _last, in_use in entries:
                if total + incoming <= self.cap_bytes:
                    break
                if in_use or digest == keep:
                    continue
                remove_tree(self._bundle(digest))
                total -= size
                removed.append(digest)
        return removed

    def _sweep_staging(self, max_age_s: float = 6 * 3600) -> None:
        # An unpack killed half way leaves `<hex>.unpack-*`; none runs that long.
        now = time.time()
        for child in (self.root / "rootfs").glob("*.unpack-*"):
            with contextlib.suppress(OSError):
                if now - child.stat().st_mtime > max_age_s:
                    remove_tree(child)


@dataclass(frozen=True)
class CachedImage:
    """One image of `ImageCache.listing()`: `refs` pinned to its `digest` on this node (none for an
    image only reached by a reference since re-pinned), `size_bytes`, `last_used` (Unix time), and
    `in_use` (a live runtime holds it)."""

    digest: str
    refs: tuple[str, ...]
    size_bytes: int
    last_used: float
    in_use: bool


@dataclass(frozen=True)
class PullEvent:
    """One step of `pull_image` for `ref`: `stage` "resolving" (the reference parsed, this node's pin
    read), "pulling" (skopeo copy), "unpacking" (umoci), "done" (`digest`, `size_bytes` unpacked,
    `cached`: no tool ran) or "failed" (`error`: skopeo's, umoci's or the cache's message)."""

    ref: str
    stage: str
    digest: str | None = None
    size_bytes: int | None = None
    cached: bool = False
    error: str | None = None


def pull_image(ref: str, cache: ImageCache | None = None,
               on_event: Callable[[PullEvent], None] | None = None) -> Image:
    """Pull and unpack `ref` into this node's cache (`ImageCache.ensure`, no runtime user), telling
    `on_event` each stage, then "done" or "failed".  A cache hit asks no registry and runs no tool.
    Raises `RuntimeSetupError` as `ensure` does (after the "failed" event)."""
    notify = on_event or (lambda _event: None)
    stages: list[str] = []

    def stage(name: str) -> None:
        stages.append(name)
        notify(PullEvent(ref, name))

    try:
        image = (cache or ImageCache()).ensure(ref, on_stage=stage)
    except RuntimeSetupError as exc:
        notify(PullEvent(ref, "failed", error=str(exc)))
        raise
    notify(PullEvent(ref, "done", image.digest, image.size_bytes, cached="pulling" not in stages))
    return image


def _read_digest(ref_file: Path) -> str | None:
    try:
        return json.loads(ref_file.read_text())["digest"]
    except (OSError, ValueError, KeyError):
        return None


def _in_use(bundle: Path) -> bool:
    """True when a user file names a runtime folder that still exists (stale users are dropped)."""
    users = bundle / "users"
    busy = False
    for user in users.iterdir() if users.is_dir() else ():
        try:
            root = user.read_text().strip()
        except OSError:
            continue
        if not root or Path(root).exists():
            busy = True
        else:
            user.unlink(missing_ok=True)
    return busy


def remove_tree(path: Path) -> None:
    """Delete `path` (a folder), also where the image made folders read-only; errors are ignored."""
    # umoci's rootless unpack keeps the image's modes, so some folders are not writable by us.
    def onerror(func, p, _exc):
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
            func(p)

    shutil.rmtree(path, onerror=onerror)
