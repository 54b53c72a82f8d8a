"""swebench's reinstall step in an eval script, in a grade with no network and a read-only env.

Unit part on a rootfs laid out here; the last test grades the fixture row on the CI fixture image
(real skopeo, umoci, bubblewrap), whose `testbed` env installs /testbed in develop mode as
SWE-bench images do.  Before, the step ran, failed (read-only env, no index) and the grade went on
as if nothing had happened, with nothing in the report.
"""
from __future__ import annotations

import subprocess

import pytest

from app.grading.image import REINSTALL_TARGET, develop_install, offline_eval_script

SCRIPT = "\n".join(["#!/bin/bash", "set -uxo pipefail", "source /opt/miniconda3/bin/activate", "cd /testbed",
                    "python -m pip install -e .[test] --verbose", "git checkout abc tests/t.py",
                    ": '>>>>> Start Test Output'", "pytest -rA tests/t.py", "pip install nothing-after-the-marker",
                    ": '>>>>> End Test Output'"])


def env(tmp_path, egg_link: str | None):
    root = tmp_path / "rootfs"
    site = root / "opt/miniconda3/envs/testbed/lib/python3.9/site-packages"
    site.mkdir(parents=True)
    (site / "distutils-precedence.pth").write_text("import os\n")
    if egg_link is not None:
        (site / "pkg.egg-link").write_text(egg_link)
    return root


def test_a_develop_install_in_the_image_drops_the_step(tmp_path):
    root = env(tmp_path, "/testbed\n.\n")
    assert develop_install(root, "/testbed") == "opt/miniconda3/envs/testbed/lib/python3.9/site-packages/pkg.egg-link"
    script, done = offline_eval_script(SCRIPT, root, "/testbed")
    assert [d["command"] for d in done] == ["python -m pip install -e .[test] --verbose"]
    assert "develop mode" in done[0]["action"]
    assert "pip install -e" not in script.split(">>>>> Start")[0].replace("dropped python -m pip install -e", "")
    assert "pip install nothing-after-the-marker" in script  # the tests' own part is never touched
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0


@pytest.mark.parametrize("egg_link", [None, "/elsewhere\n"])
def test_without_one_the_step_runs_offline_into_a_scratch_target(tmp_path, egg_link):
    root = env(tmp_path, egg_link)
    assert develop_install(root, "/testbed") is None
    script, done = offline_eval_script(SCRIPT, root, "/testbed")
    assert "--no-index --no-deps --no-build-isolation" in script and f"--target {REINSTALL_TARGET}" in script
    assert f"export PYTHONPATH={REINSTALL_TARGET}" in script and done[0]["action"].startswith("offline")


@pytest.mark.slow
def test_the_fixture_grade_reports_what_it_did_with_the_step(tmp_path):
    from app.config import get_settings
    from app.grading.grader import grade
    from app.tasksets.loader import load_published
    from support.format_fixtures import format_fixtures
    from support.registry import fixture_layout

    from app.runtimes.oci import OciRuntime

    image = f"oci:{fixture_layout()}:fixture"
    probe = format_fixtures(tmp_path / "probe", image=image)
    with OciRuntime.prepare(load_published(probe / "swebench_verified.jsonl")[0][0], purpose="grade") as rt:
        base = rt.base_commit  # the image's own commit of /testbed
    rows = format_fixtures(tmp_path / "rows", image=image, base_commit=base)
    rec = load_published(rows / "swebench_verified.jsonl")[0][0]
    result = grade(rec, rec.patch, settings=get_settings(), use_cache=False, timeout_s=300)
    assert result.resolved, result.log_path
    assert result.report["eval_install"] == [{"command": "python -m pip install .", "action": (
        "dropped: the image installs /testbed in develop mode "
        "(/opt/miniconda3/envs/testbed/lib/python3.11/site-packages/requests.egg-link)")}]


def test_a_site_packages_link_is_followed_inside_the_image_never_on_the_host(tmp_path):
    root = env(tmp_path, None)
    lib = root / "opt/miniconda3/envs/testbed/lib"
    host = tmp_path / "host-python"          # a host folder an image's link names absolutely
    (host / "site-packages").mkdir(parents=True)
    (host / "site-packages" / "evil.egg-link").write_text("/testbed\n")
    (lib / "python3.10").symlink_to(host)
    assert develop_install(root, "/testbed") is None   # the host's folder is not the image's
    # The same absolute link resolved inside the image: /opt/... of the rootfs, which holds the egg-link.
    (root / "opt/inner/site-packages").mkdir(parents=True)
    (root / "opt/inner/site-packages" / "pkg.egg-link").write_text("/testbed\n")
    (lib / "python3.11").symlink_to("/opt/inner")
    assert develop_install(root, "/testbed") == "opt/inner/site-packages/pkg.egg-link"
