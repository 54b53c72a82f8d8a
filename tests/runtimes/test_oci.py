"""OciRuntime on the SWE-bench-layout fixture image, served by a real `docker-registry` on loopback
and pulled with skopeo: commands in /testbed with the `testbed` env as swebench's eval scripts
activate it, per-episode copies, the read-only shared rootfs, gateway-only network, harness CLIs
mounted from the host, and refusals that name the image.

The fixture (scripts/build_fixture_image.sh) stands in for a published SWE-bench instance image
such as `swebench/sweb.eval.x86_64.psf_1776_requests-6028`: psf/requests 2.27 at /testbed, an env
`testbed` under /opt/miniconda3 (a venv behind a conda-style activate script).
"""
from __future__ import annotations

import http.server
import threading
from pathlib import Path

import pytest

from app.config import get_settings
from app.harnesses import get_preset
from app.runtimes import RuntimeSetupError, attach_runtime
from app.runtimes.images import ImageCache, remove_tree
from app.runtimes.oci import OciRuntime
from app.runtimes.paths import RuntimePaths
from app.runtimes.sandbox import Mount
from support.registry import Registry, fixture_layout, layer_image, tar_of

pytestmark = pytest.mark.slow

# swebench's eval scripts open with exactly these lines (swebench 5.0.2 harness/test_spec/python.py).
ACTIVATE = "source /opt/miniconda3/bin/activate && conda activate testbed && cd /testbed"


def record(image: str, **extra) -> dict:
    return {"instance_id": "psf__requests-fixture", "repo": "psf/requests", "version": "2.27", "patch": "x",
            "problem_statement": "p", "FAIL_TO_PASS": ["tests/test_utils.py::test_x"], "PASS_TO_PASS": [],
            "base_commit": "abcdef1", "test_cmd": "pytest", "image": image, **extra}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(registry reference of the fixture image, RuntimePaths with a cache shared by this module)."""
    base = tmp_path_factory.mktemp("oci")
    with Registry(base / "registry") as reg:
        ref = reg.push(f"oci:{fixture_layout()}:fixture", "swe/requests:2.27")
        paths = RuntimePaths(base / "var", base / "cache")
        ImageCache(get_settings(), paths).ensure(ref)  # the cold pull, once for the module
        yield ref, paths
    remove_tree(base)  # ~350 MB unpacked: not left for pytest's kept temp folders


@pytest.fixture
def runtime(served):
    ref, paths = served
    rt = OciRuntime.prepare(record(ref), paths=paths)
    yield rt
    rt.close()


def test_commands_run_in_the_repository_with_the_testbed_env(runtime):
    res = runtime.run(f"{ACTIVATE} && python -c 'import requests, sys; print(requests.__version__, "
                      "requests.__file__, sys.prefix)' && git log --format=%s -1 && id -u && echo $LANG")
    assert res.ok, res.stderr
    version, module, prefix, subject, uid, lang = res.stdout.split()[:3] + res.stdout.splitlines()[1:]
    assert (version, module, prefix) == ("2.27.1", "/testbed/requests/__init__.py", "/opt/miniconda3/envs/testbed")
    assert subject.startswith("requests 2.27.1") and uid == "0" and lang == "C.UTF-8"
    assert runtime.workdir == "/testbed" and runtime.confined
    head = runtime.run("git rev-parse HEAD").stdout.strip()
    assert head == runtime.base_commit and len(head) == 40


def test_the_fixtures_tests_run_as_an_eval_script_runs_them(runtime):
    res = runtime.run(f"{ACTIVATE} && pytest -rA -p no:cacheprovider tests/test_utils.py -k prepend_scheme", timeout_s=300)
    assert res.ok, res.stdout[-3000:] + res.stderr[-2000:]
    assert "PASSED tests/test_utils.py::test_prepend_scheme_if_needed" in res.stdout


def test_each_episode_has_its_own_copy_over_a_read_only_image(served):
    ref, paths = served
    a, b = OciRuntime.prepare(record(ref), paths=paths), OciRuntime.prepare(record(ref), paths=paths)
    try:
        assert a.run("echo from-a > NEW.txt && echo '# edited' >> requests/api.py").ok
        assert b.run("test ! -e NEW.txt && ! grep -q edited requests/api.py").ok
        patch_a, patch_b = a.patch(), b.patch()
        assert "b/NEW.txt" in patch_a and "+# edited" in patch_a and patch_b == ""
        assert not (a.rootfs / "testbed" / "NEW.txt").exists() and a.rootfs == b.rootfs  # one shared image
        for target in ("/usr/lib/planted", "/opt/miniconda3/envs/testbed/planted", "/etc/planted"):
            res = a.run(f"echo x > {target}")
            assert res.exit_code != 0 and "Read-only file system" in res.stderr, target
        # Python's own byte-code caches are by-products, not part of the patch.
        assert a.run(f"{ACTIVATE} && python -c 'import requests.api'").ok
        assert "__pycache__" not in a.patch()
    finally:
        a.close()
        b.close()
    assert not a.root.exists() and not list((a.rootfs.parent / "users").glob(f"{a.id}*"))


def test_state_round_trips_and_close_is_idempotent(runtime):
    again = attach_runtime(runtime.describe())
    assert isinstance(again, OciRuntime) and again.run("pwd").stdout.strip() == "/testbed"
    again.close()
    again.close()
    assert not runtime.root.exists()


def test_network_none_has_no_route_and_gateway_reaches_only_the_gateway(served):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ref, paths = served
    rt = OciRuntime.prepare(record(ref), paths=paths, gateway_url=f"http://127.0.0.1:{server.server_address[1]}/")
    probe = ("python3 -c \"import socket,sys,urllib.request\ntry:\n socket.create_connection(('1.1.1.1', 80), "
             "timeout=3); print('outside reached')\nexcept OSError: print('outside blocked')\n"
             "try: print('gateway', urllib.request.urlopen(sys.argv[1], timeout=5).status)\n"
             "except OSError: print('gateway blocked')\" ")
    try:
        none = rt.run(probe + rt.gateway_url, network="none")
        gateway = rt.run(probe + rt.gateway_url, network="gateway")
    finally:
        rt.close()
        server.shutdown()
    assert none.stdout.split("\n")[:2] == ["outside blocked", "gateway blocked"], none.stderr
    assert gateway.stdout.split("\n")[:2] == ["outside blocked", "gateway 200"], gateway.stderr


@pytest.mark.parametrize("harness", ["mini-swe-agent", "pi"])
def test_harness_clis_run_inside_the_image_from_host_mounts(served, harness):
    preset = get_preset(harness)
    if not preset.is_installed():
        pytest.fail(f"{harness} is not installed: run `make ci-deps` (or `python -m app harness install {harness}`)")
    ref, paths = served
    rt = OciRuntime.prepare(record(ref), paths=paths, ro_binds=preset.image_binds(), programs=preset.image_programs(),
                            harness=harness)
    try:
        assert rt.run("command -v node mini pi || true").stdout.strip() == ""  # the image has none of them
        res = rt.run([str(preset.executable), "--help"], path_prepend=preset.image_path_prepend(),
                     env={"MSWEA_CONFIGURED": "true"}, timeout_s=120)
    finally:
        rt.close()
    assert res.ok, res.stderr[-2000:]
    assert ("mini-swe-agent version 2.4.6" if harness == "mini-swe-agent" else "Built-in Tool Names") in res.stdout + res.stderr


def test_the_image_configs_user_env_and_working_dir_apply(tmp_path):
    # A bare image (no /usr of its own) with the host's /usr mounted in, to have `id` and `env`.
    ref = layer_image(tmp_path / "bare", tar_of(tmp_path / "bare.tar", [
        ("dir", "work", None), ("dir", "work/repo", None), ("file", "work/repo/README", "hi"),
        ("symlink", "bin", "usr/bin"), ("symlink", "lib", "usr/lib"), ("symlink", "lib64", "usr/lib64")]),
        workdir="/work/repo", user="1000:1000", env=("GREETING=from-image",))
    rt = OciRuntime.prepare(record(ref), paths=RuntimePaths(tmp_path / "var", tmp_path / "cache"))
    try:
        res = rt.run(["/usr/bin/sh", "-c", "id -u; id -g; pwd; echo $GREETING; ls; touch made-here"],
                     extra_mounts=[Mount(Path("/usr"), "/usr")])
        assert res.ok, res.stderr
        assert res.stdout.split() == ["1000", "1000", "/work/repo", "from-image", "README"]
        assert rt.workdir == "/work/repo" and (rt.workspace / "made-here").exists()  # the repo copy is theirs
        assert "b/made-here" in rt.patch()  # no git history in the image: diffed against a snapshot
    finally:
        rt.close()


def test_a_musl_image_is_refused_for_a_glibc_harness_naming_the_image(tmp_path):
    ref = layer_image(tmp_path / "musl", tar_of(tmp_path / "musl.tar", [
        ("dir", "testbed", None), ("dir", "lib", None), ("file", "lib/ld-musl-x86_64.so.1", "not really")]))
    preset = get_preset("mini-swe-agent")
    with pytest.raises(RuntimeSetupError) as info:
        OciRuntime.prepare(record(ref), paths=RuntimePaths(tmp_path / "var", tmp_path / "cache"),
                           ro_binds=preset.image_binds(), programs=preset.image_programs(), harness="mini-swe-agent")
    assert info.value.stage == "harness"
    assert ref in str(info.value) and "musl" in str(info.value) and "mini-swe-agent" in str(info.value)


def test_a_missing_tag_fails_prepare_with_the_registrys_answer(served):
    ref, paths = served
    with pytest.raises(RuntimeSetupError) as info:
        OciRuntime.prepare(record(ref.replace(":2.27", ":0.0-missing")), paths=paths)
    assert info.value.stage == "image" and "manifest unknown" in str(info.value)
    assert not any(p.name.startswith("episo") for p in paths.runtimes.iterdir())  # nothing left behind


def test_a_grade_runs_in_a_fresh_runtime_of_the_same_image(served):
    """What a grader does: the agent's patch applied in a fresh copy, then the tests."""
    ref, paths = served
    with OciRuntime.prepare(record(ref), paths=paths) as episode:
        assert episode.run("sed -i 's/^def prepend_scheme_if_needed/def prepend_scheme_if_needed_renamed/' "
                           "requests/utils.py").ok
        patch = episode.patch()
    assert "prepend_scheme_if_needed_renamed" in patch
    with OciRuntime.prepare(record(ref), paths=paths, purpose="grade") as grade:
        assert grade.run("git apply -", stdin=patch).ok
        res = grade.run(f"{ACTIVATE} && pytest -q -p no:cacheprovider tests/test_utils.py -k prepend_scheme",
                        timeout_s=300)
    assert res.exit_code != 0 and "ImportError" in res.stdout + res.stderr
    assert Path(grade.root).exists() is False


def test_an_image_link_over_a_host_mount_point_is_not_followed(tmp_path):
    """An image whose /work links into its repository: the harness tools mounted under /work must
    land on their own path, not in the episode's workspace."""
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "tool.txt").write_text("a host tool\n")
    ref = layer_image(tmp_path / "links", tar_of(tmp_path / "links.tar", [
        ("dir", "testbed", None), ("symlink", "work", "/testbed"),
        ("symlink", "bin", "usr/bin"), ("symlink", "lib", "usr/lib"), ("symlink", "lib64", "usr/lib64")]))
    rt = OciRuntime.prepare(record(ref), paths=RuntimePaths(tmp_path / "var", tmp_path / "cache"),
                            ro_binds=[(str(tools), f"/work/opt/{tools.name}")])
    try:
        res = rt.run(["/usr/bin/cat", f"/work/opt/{tools.name}/tool.txt"], extra_mounts=[Mount(Path("/usr"), "/usr")])
        assert res.ok and res.stdout == "a host tool\n", res.stderr
        assert list(rt.workspace.iterdir()) == []  # nothing was created through the link
    finally:
        rt.close()


def test_a_missing_tag_fails_the_episodes_prepare_with_the_registrys_answer(served, monkeypatch):
    """The path an episode takes (`RealStages.prepare`, as `app.control.episodes.prepare` calls it):
    the error the episode row gets names the reference and carries the registry's answer."""
    from app.control.real_stages import RealStages
    from app.runconfig import RunConfig

    ref, paths = served
    missing = ref.replace(":2.27", ":9.9-missing")
    monkeypatch.setattr(RuntimePaths, "from_settings", classmethod(lambda cls, s=None: paths))
    cfg = RunConfig.model_validate({"kind": "train", "harness": "mini-swe-agent", "runtime": "auto"})
    with pytest.raises(RuntimeSetupError) as info:
        RealStages().prepare(record(missing), 1, cfg)
    row_error = f"prepare failed: {type(info.value).__name__}: {info.value}"  # episodes.prepare's words
    assert info.value.stage == "image" and missing.removeprefix("docker://") in row_error
    assert "manifest unknown" in row_error


def test_preflight_refuses_a_harness_the_cached_image_cannot_run(tmp_path, monkeypatch):
    """At run creation: an image already in the node's cache is checked against the harness."""
    from app.control.preflight import check_images
    from app.runconfig import RunConfig
    from app.tasksets.schema import InstanceRecord

    paths = RuntimePaths(tmp_path / "var", tmp_path / "cache")
    monkeypatch.setattr(RuntimePaths, "from_settings", classmethod(lambda cls, s=None: paths))
    ref = layer_image(tmp_path / "musl", tar_of(tmp_path / "musl.tar", [
        ("dir", "testbed", None), ("dir", "lib", None), ("file", "lib/ld-musl-x86_64.so.1", "not really")]))
    rec = InstanceRecord.model_validate(record(ref))
    cfg = RunConfig.model_validate({"kind": "train", "harness": "mini-swe-agent", "runtime": "auto"})
    assert check_images(cfg, [rec]) is None  # not pulled yet: checked at prepare, when it is
    ImageCache(get_settings(), paths).ensure(ref)
    field, message = check_images(cfg, [rec])
    assert field == "harness" and ref in message and "musl" in message and rec.instance_id in message
