"""The node's image cache with the real tools: skopeo pulls from a real `docker-registry` on
loopback, a `docker save` tarball and OCI layouts; `umoci unpack --rootless` unpacks; eviction,
the per-node unpack gate and hostile layers (path traversal, links out of the rootfs, device
nodes) are shown on small images built here with umoci."""
from __future__ import annotations

import os
import subprocess
from concurrent.futures import ProcessPoolExecutor
import multiprocessing
from pathlib import Path

import pytest

from app.config import get_settings
from app.runtimes import RuntimeSetupError
from app.runtimes.images import ImageCache, parse_reference, remove_tree
from app.runtimes.oci import OciRuntime
from app.runtimes.paths import RuntimePaths
from support.registry import Registry, fixture_layout, layer_image, tar_of

pytestmark = pytest.mark.slow


def _cache(tmp_path: Path, cap: int | None = None) -> ImageCache:
    return ImageCache(get_settings(), RuntimePaths(tmp_path / "var", tmp_path / "cache"), cap_bytes=cap)


def _tiny(tmp_path: Path, name: str, size: int = 1000) -> str:
    """A one-layer image named `name` holding /testbed/data (`size` bytes) and a tracked repo-less folder."""
    tar = tar_of(tmp_path / f"{name}.tar", [("dir", "testbed", None), ("file", "testbed/data", name * (size // len(name)))])
    return layer_image(tmp_path / f"layout-{name}", tar, tag=name, workdir="/testbed")


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A real registry serving the SWE-bench-layout fixture image as swe/requests:2.27."""
    with Registry(tmp_path_factory.mktemp("registry")) as reg:
        reg.ref = reg.push(f"oci:{fixture_layout()}:fixture", "swe/requests:2.27")
        yield reg


def test_references_parse_to_skopeo_sources(tmp_path):
    bare = parse_reference("swebench/sweb.eval.x86_64.psf_1776_requests-6028")
    assert bare.source == "docker://swebench/sweb.eval.x86_64.psf_1776_requests-6028:latest" and not bare.loopback
    local = parse_reference("docker://127.0.0.1:5000/swe/requests:2.27")
    assert local.loopback and local.source == "docker://127.0.0.1:5000/swe/requests:2.27"
    with pytest.raises(RuntimeSetupError) as info:
        parse_reference(f"docker-archive:{tmp_path}/missing.tar")
    assert info.value.stage == "image" and "missing.tar" in str(info.value)


def _prepare_in_process(ref: str, tmp: str, k: int) -> tuple[str, int]:
    image = _cache(Path(tmp)).ensure(ref, user=f"ep-{k}", user_root=Path(tmp))
    return image.digest, os.getpid()


def test_a_group_of_eight_pulls_and_unpacks_a_new_image_once(registry, tmp_path, monkeypatch, request):
    """Eight worker processes prepare episodes of one image new to the node at the same time."""
    # A counting wrapper in front of the real umoci and skopeo: how many times each really ran.
    shims = tmp_path / "shims"
    shims.mkdir()
    for tool in ("umoci", "skopeo"):
        shim = shims / tool
        shim.write_text(f"#!/bin/sh\necho \"$1\" >> {tmp_path}/{tool}.calls\nexec /usr/bin/{tool} \"$@\"\n")
        shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shims}:{os.environ['PATH']}")
    request.addfinalizer(lambda: remove_tree(tmp_path / "cache"))  # ~350 MB unpacked
    with ProcessPoolExecutor(8, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(_prepare_in_process, [registry.ref] * 8, [str(tmp_path)] * 8, range(8)))
    assert len({digest for digest, _pid in results}) == 1 and len({pid for _d, pid in results}) > 1
    assert (tmp_path / "umoci.calls").read_text().split() == ["unpack"]
    assert (tmp_path / "skopeo.calls").read_text().split() == ["copy"]
    cache = _cache(tmp_path)
    image = cache.ensure(registry.ref)  # warm: no tool runs at all (the digest is pinned on this node)
    assert (tmp_path / "umoci.calls").read_text().split() == ["unpack"]
    assert (image.rootfs / "testbed" / ".git").is_dir() and image.config.cwd == "/testbed"
    assert len(list((image.bundle / "users").iterdir())) == 8
    assert not (cache.root / "layouts" / parse_reference(registry.ref).key).exists()  # pulled layout removed


def test_missing_tag_fails_with_the_registrys_answer(registry, tmp_path):
    with pytest.raises(RuntimeSetupError) as info:
        _cache(tmp_path).ensure(registry.ref.replace(":2.27", ":no-such-tag"))
    assert info.value.stage == "image"
    assert "manifest unknown" in str(info.value) and "no-such-tag" in str(info.value)


def test_docker_save_tarball_and_oci_layout_give_the_same_rootfs(tmp_path):
    ref = _tiny(tmp_path, "alpha")
    archive = tmp_path / "alpha-docker-save.tar"
    subprocess.run(["skopeo", "copy", "--quiet", ref, f"docker-archive:{archive}:swe/alpha:1"], check=True)
    cache = _cache(tmp_path)
    from_layout, from_archive = cache.ensure(ref), cache.ensure(f"docker-archive:{archive}")
    for image in (from_layout, from_archive):
        assert (image.rootfs / "testbed" / "data").read_text().startswith("alpha")
    assert from_archive.config.cwd == "/testbed"


def test_least_recently_used_image_is_evicted_past_the_cap(tmp_path):
    probe = _cache(tmp_path / "probe").ensure(_tiny(tmp_path, "probe", 50_000))
    cache = _cache(tmp_path, cap=int(probe.size_bytes * 2.5))  # room for two images, not three
    first = cache.ensure(_tiny(tmp_path, "first", 50_000))
    second = cache.ensure(_tiny(tmp_path, "second", 50_000))
    os.utime(second.bundle / "last_used", (1, 1))  # used longest ago now: the one to go
    os.utime(first.bundle / "last_used")
    third = cache.ensure(_tiny(tmp_path, "third", 50_000))
    assert {d for d, *_ in cache.entries()} == {first.digest, third.digest}
    assert not second.bundle.exists() and cache.total_bytes() <= cache.cap_bytes


def test_an_image_in_use_is_never_evicted_and_the_cap_holds(tmp_path):
    probe = _cache(tmp_path / "probe").ensure(_tiny(tmp_path, "probe", 50_000))
    cache = _cache(tmp_path, cap=int(probe.size_bytes * 1.5))  # one image only
    held = cache.ensure(_tiny(tmp_path, "held", 50_000), user="ep-1", user_root=tmp_path)
    with pytest.raises(RuntimeSetupError) as info:
        cache.ensure(_tiny(tmp_path, "other", 50_000))
    assert info.value.stage == "image cache" and "TURNSTILE_IMAGE_CACHE_BYTES" in str(info.value)
    assert held.bundle.exists() and cache.total_bytes() <= cache.cap_bytes
    cache.release(held.digest, "ep-1")
    other = cache.ensure(_tiny(tmp_path, "other", 50_000))  # now the held one may go
    assert not held.bundle.exists() and other.bundle.exists()


def test_a_user_whose_runtime_folder_vanished_no_longer_holds_the_image(tmp_path):
    probe = _cache(tmp_path / "probe").ensure(_tiny(tmp_path, "probe", 50_000))
    cache = _cache(tmp_path, cap=int(probe.size_bytes * 1.5))
    gone = tmp_path / "runtimes" / "crashed-episode"
    gone.mkdir(parents=True)
    held = cache.ensure(_tiny(tmp_path, "held", 50_000), user="crashed", user_root=gone)
    gone.rmdir()  # its worker died without close()
    cache.ensure(_tiny(tmp_path, "next", 50_000))
    assert not held.bundle.exists()


# --- hostile layers ---------------------------------------------------------------------------

def _outside(tmp_path: Path) -> Path:
    target = tmp_path / "host-secret"
    target.mkdir(exist_ok=True)
    (target / "secret.txt").write_text("host secret\n")
    return target


def test_path_traversal_entries_stay_inside_the_rootfs(tmp_path):
    host = _outside(tmp_path)
    ref = layer_image(tmp_path / "evil", tar_of(tmp_path / "evil.tar", [
        ("dir", "testbed", None), ("file", f"../../../../..{host}/escaped-1", "x"),
        ("file", f"{host}/escaped-2", "x"), ("file", "testbed/../../../escaped-3", "x")]))
    image = _cache(tmp_path).ensure(ref)
    assert sorted(p.name for p in host.iterdir()) == ["secret.txt"]
    assert not Path("/escaped-3").exists() and not (tmp_path / "escaped-3").exists()
    assert (image.rootfs / "escaped-3").is_file()  # kept, but inside


def test_symlinks_out_of_the_rootfs_expose_no_host_file(tmp_path):
    host = _outside(tmp_path)
    ref = layer_image(tmp_path / "evil", tar_of(tmp_path / "evil.tar", [
        ("dir", "testbed", None), ("symlink", "testbed/out", str(host)), ("file", "testbed/out/planted", "x"),
        ("symlink", "up", f"../../../../../..{host}"), ("file", "up/planted-2", "x"),
        ("symlink", "testbed/secret", f"{host}/secret.txt")]), workdir="/testbed")
    paths = RuntimePaths(tmp_path / "var", tmp_path / "cache")
    image = _cache(tmp_path).ensure(ref)
    assert sorted(p.name for p in host.iterdir()) == ["secret.txt"]  # writes through links stayed inside
    record = {"instance_id": "evil__image-1", "repo": "evil/image", "patch": "x", "problem_statement": "p",
              "FAIL_TO_PASS": ["t::x"], "PASS_TO_PASS": [], "base_commit": "abcdef1", "test_cmd": "true", "image": ref}
    rt = OciRuntime.prepare(record, paths=paths)
    try:
        res = rt.run(["/bin/cat", "/testbed/secret"])  # no /bin/cat in this image, and no host file either
        assert res.exit_code != 0 and "host secret" not in res.stdout
        assert os.path.islink(rt.workspace / "secret")  # copied as a link, never followed on the host
    finally:
        rt.close()
    assert (image.rootfs / "testbed" / "out").is_symlink()


def test_a_repository_folder_that_links_to_the_root_is_refused(tmp_path):
    ref = layer_image(tmp_path / "evil", tar_of(tmp_path / "evil.tar", [("symlink", "testbed", "/")]))
    record = {"instance_id": "evil__image-2", "repo": "evil/image", "patch": "x", "problem_statement": "p",
              "FAIL_TO_PASS": ["t::x"], "PASS_TO_PASS": [], "base_commit": "abcdef1", "test_cmd": "true", "image": ref}
    with pytest.raises(RuntimeSetupError) as info:
        OciRuntime.prepare(record, paths=RuntimePaths(tmp_path / "var", tmp_path / "cache"))
    assert info.value.stage == "repository" and "/testbed" in str(info.value)


def test_hard_links_to_host_files_fail_the_unpack(tmp_path):
    ref = layer_image(tmp_path / "evil", tar_of(tmp_path / "evil.tar", [
        ("dir", "testbed", None), ("hardlink", "testbed/hostname", "/etc/hostname")]))
    with pytest.raises(RuntimeSetupError) as info:
        _cache(tmp_path).ensure(ref)
    assert info.value.stage == "image" and "unpack" in str(info.value)


def test_device_nodes_become_empty_files(tmp_path):
    ref = layer_image(tmp_path / "evil", tar_of(tmp_path / "evil.tar", [
        ("dir", "testbed", None), ("chr", "testbed/mem", (1, 1)), ("chr", "testbed/null", (1, 3))]))
    image = _cache(tmp_path).ensure(ref)
    for name in ("mem", "null"):
        st = (image.rootfs / "testbed" / name).lstat()
        assert not (st.st_mode & 0o170000 == 0o020000) and st.st_size == 0  # a regular, empty file
