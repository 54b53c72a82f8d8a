"""Pre-pulling with the real tools: `turnstile images pull` and `tasks prefetch` fill the node's
cache from an OCI layout, a `docker save` tarball and a real `docker-registry` on loopback (also
reached as a mirror through the registries.conf skopeo reads); a second pull is a cache hit that
runs no tool; a missing file, a missing tag and a missing tool fail with their own words and
exit 1.  Images are tiny one-layer images built here with umoci."""
from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from app import config
from app.cli import main
from app.cli.pulls import pull_all
from app.runtimes import RuntimeSetupError
from app.runtimes.images import ImageCache, pull_image
from support.registry import Registry, layer_image, tar_of

pytestmark = pytest.mark.slow


def _tiny(folder: Path, name: str) -> str:
    """An OCI layout under `folder` holding image `name`: /testbed/data reads `name`."""
    tar = tar_of(folder / f"{name}.tar", [("dir", "testbed", None), ("file", "testbed/data", name)])
    return layer_image(folder / "layout", tar, tag=name, workdir="/testbed")


@pytest.fixture
def node(tmp_path, monkeypatch):
    """This test's node: its own image cache (TURNSTILE_CACHE_DIR) and counting wrappers in front of
    the real skopeo and umoci (`node.calls()`: the pulls and unpacks that ran, in order)."""
    shims = tmp_path / "shims"
    shims.mkdir()
    for tool in ("skopeo", "umoci"):
        shim = shims / tool
        shim.write_text(f"#!/bin/sh\necho \"{tool} $1\" >> {tmp_path}/calls\nexec /usr/bin/{tool} \"$@\"\n")
        shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shims}:{os.environ['PATH']}")
    monkeypatch.setenv("TURNSTILE_CACHE_DIR", str(tmp_path / "cache"))
    config.reset_settings()

    class Node:
        root = tmp_path

        @staticmethod
        def calls() -> list[str]:
            log = tmp_path / "calls"
            # The test's own image builds (umoci init, new, raw, config) are not the cache's work.
            lines = log.read_text().splitlines() if log.exists() else []
            return [line for line in lines if line in ("skopeo copy", "umoci unpack")]

        @staticmethod
        def cache() -> ImageCache:
            return ImageCache()

    yield Node
    config.reset_settings()


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A real registry on loopback serving a tiny image as swe/tiny:1."""
    folder = tmp_path_factory.mktemp("registry")
    with Registry(folder / "registry") as reg:
        reg.ref = reg.push(_tiny(folder, "served"), "swe/tiny:1")
        yield reg


def test_pull_from_an_oci_layout_fills_the_cache_and_a_second_pull_is_a_hit(node, capsys):
    ref = _tiny(node.root, "alpha")
    assert main(["images", "pull", ref]) == 0
    out = capsys.readouterr().out
    image = node.cache().cached(ref)
    assert image is not None and (image.rootfs / "testbed" / "data").read_text() == "alpha"
    assert [c.digest for c in node.cache().listing()] == [image.digest]
    assert [f"{ref}: {stage}" for stage in ("resolving", "pulling", "unpacking")] == out.splitlines()[:3]
    assert f"{ref}: done {image.digest} " in out and "1 pulled, 0 in the cache already, 0 failed" in out
    assert node.calls() == ["skopeo copy", "umoci unpack"]

    assert main(["images", "pull", ref]) == 0  # the node's pin: no registry, no skopeo, no umoci
    out = capsys.readouterr().out
    assert f"{ref}: done {image.digest}" in out and "(in the cache already)" in out and "pulling" not in out
    assert node.calls() == ["skopeo copy", "umoci unpack"]


def test_pull_image_reports_each_stage_of_a_docker_save_tarball(node):
    archive = node.root / "beta-docker-save.tar"
    subprocess.run(["/usr/bin/skopeo", "copy", "--quiet", _tiny(node.root, "beta"), f"docker-archive:{archive}:swe/beta:1"],
                   check=True)
    ref = f"docker-archive:{archive}"
    events: list = []
    image = pull_image(ref, node.cache(), on_event=events.append)
    assert [e.stage for e in events] == ["resolving", "pulling", "unpacking", "done"]
    assert events[-1].digest == image.digest and events[-1].size_bytes == image.size_bytes > 0 and not events[-1].cached
    assert (node.cache().cached(ref).rootfs / "testbed" / "data").read_text() == "beta"
    again: list = []
    assert pull_image(ref, node.cache(), on_event=again.append).digest == image.digest
    assert [e.stage for e in again] == ["resolving", "done"] and again[-1].cached


def test_pull_from_a_loopback_registry_and_list_the_cache(node, registry, capsys):
    assert main(["images", "pull", registry.ref]) == 0
    digest = node.cache().cached(registry.ref).digest
    capsys.readouterr()
    assert main(["images", "list"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if digest in line)
    assert registry.ref in row and " no " in row  # pinned reference shown; no runtime holds it


def test_a_registries_conf_mirror_in_home_serves_a_name_the_registry_never_had(node, registry, monkeypatch):
    """containers-registries.conf(5): skopeo reads $HOME/.config/containers/registries.conf; a
    [[registry.mirror]] is tried before the prefix's own location, which here does not resolve."""
    conf = node.root / "home" / ".config" / "containers" / "registries.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text('[[registry]]\nprefix = "registry.invalid"\nlocation = "registry.invalid"\n'
                    f'[[registry.mirror]]\nlocation = "{registry.host}"\ninsecure = true\n')
    direct = pull_image(registry.ref, node.cache())
    monkeypatch.setenv("HOME", str(node.root / "home"))
    mirrored = pull_image("docker://registry.invalid/swe/tiny:1", node.cache())
    assert mirrored.digest == direct.digest
    assert node.calls().count("skopeo copy") == 2


def test_missing_file_and_missing_tag_fail_in_their_own_words_and_exit_1(node, registry, capsys):
    good = _tiny(node.root, "gamma")
    missing_tag = registry.ref.replace(":1", ":no-such-tag")
    code = main(["images", "pull", f"docker-archive:{node.root}/missing.tar", missing_tag, good])
    out = capsys.readouterr().out
    assert code == 1
    assert f"docker-archive:{node.root}/missing.tar: failed: image: docker-archive:{node.root}/missing.tar: no such file" in out
    tag_line = next(line for line in out.splitlines() if line.startswith(f"{missing_tag}: failed"))
    assert "manifest unknown" in tag_line and "level=fatal" not in tag_line  # skopeo's message, out of its log format
    assert node.cache().cached(good) is not None and "1 pulled, 0 in the cache already, 2 failed" in out


def test_a_missing_skopeo_is_named(node, monkeypatch):
    ref = _tiny(node.root, "delta")
    monkeypatch.setenv("PATH", str(node.root / "empty-bin"))
    events: list = []
    with pytest.raises(RuntimeSetupError) as info:
        pull_image(ref, node.cache(), on_event=events.append)
    assert "`skopeo` is not installed" in str(info.value) and events[-1].stage == "failed"
    assert events[-1].error == str(info.value)


def test_on_a_terminal_each_image_is_one_live_line(node):
    refs = [_tiny(node.root, "one"), _tiny(node.root, "two")]
    screen = io.StringIO()
    assert pull_all(refs + refs[:1], Console(file=screen, force_terminal=True, width=200), jobs=2) == 0
    text = screen.getvalue()
    for ref in refs:  # the live line shows the digest as `docker images` does: sha256: and 12 hex digits
        assert f"done {node.cache().cached(ref).digest[:19]} " in text
    assert node.calls().count("skopeo copy") == 2  # the duplicate reference is pulled once


def test_tasks_prefetch_pulls_each_distinct_image_of_a_set(node, capsys):
    one, two = _tiny(node.root, "one"), _tiny(node.root, "two")
    rows = [("a__a-1", one), ("a__a-2", one), ("b__b-1", two), ("c__c-1", "")]
    task_set = node.root / "set.jsonl"
    task_set.write_text("".join(json.dumps({
        "instance_id": iid, "repo": iid.split("-")[0].replace("__", "/"), "problem_statement": "p", "patch": "x",
        "base_commit": "abcdef1", "FAIL_TO_PASS": ["t.py::x"], "PASS_TO_PASS": [], "test_cmd": "true", "image": image,
    }) + "\n" for iid, image in rows))
    assert main(["tasks", "prefetch", str(task_set)]) == 0
    out = capsys.readouterr().out
    assert "2 distinct image(s) for 4 instance(s)" in out and "1 instance(s) name no image" in out
    assert node.cache().cached(one) is not None and node.cache().cached(two) is not None
    assert node.calls().count("skopeo copy") == 2
    assert main(["tasks", "prefetch", str(task_set), "--instances", "b__b-1"]) == 0
    assert "0 pulled, 1 in the cache already, 0 failed" in capsys.readouterr().out
