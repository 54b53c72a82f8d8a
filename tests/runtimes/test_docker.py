"""DockerRuntime against a real Docker engine (skipped where none answers, e.g. this CI box: CLI only)."""
from __future__ import annotations

import subprocess

import pytest

from app.runtimes import DockerRuntime, RuntimeSetupError, attach_runtime, docker_available
from app.runtimes.docker import swebench_image
from app.tasksets import load_task_set

RECORD = load_task_set("synthetic").get("synthetic__inflection-1")


def test_swebench_image_name_follows_the_hub_convention():
    rec = RECORD.model_copy(update={"instance_id": "pallets__flask-5014", "image": ""})
    assert swebench_image(rec) == "swebench/sweb.eval.x86_64.pallets_1776_flask-5014:latest"


@pytest.mark.skipif(docker_available(), reason="a Docker engine is reachable here; the no-engine error path can't be shown")
def test_without_an_engine_prepare_says_so():
    with pytest.raises(RuntimeSetupError) as info:
        DockerRuntime.prepare(RECORD, image="python:3.11-slim")
    assert info.value.stage == "docker" and "docker info" in str(info.value)


@pytest.mark.skipif(not docker_available(), reason="no Docker engine reachable (`docker info` fails; the docker CLI alone is not enough)")
def test_container_runs_without_network_and_is_removed():
    rt = DockerRuntime.prepare(RECORD, image="python:3.11-slim")
    try:
        again = attach_runtime(rt.describe())
        assert again.run("echo hello").stdout.strip() == "hello"
        res = again.run("python -c \"import socket; socket.create_connection(('pypi.org', 443), timeout=5)\"")
        assert res.exit_code != 0
        assert again.run("sleep 30", timeout_s=2).timed_out
    finally:
        rt.close()
    names = subprocess.run(["docker", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True).stdout
    assert rt.id not in names


def test_container_diff_ignores_the_agents_git_config(tmp_path):
    # The command DockerRuntime.patch runs in the container, run here on a repository whose
    # config asks for no prefixes, an external diff and a quoted path style.
    import shlex

    from app.runtimes.docker import container_diff_command

    repo = tmp_path / "repo"
    repo.mkdir()
    env = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    (repo / "mod.py").write_text("old\n")
    for cmd in ("git init -q", "git add .", "git -c user.name=t -c user.email=t@t commit -qm base"):
        subprocess.run(shlex.split(cmd), cwd=repo, check=True, env=env)
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, env=env).stdout.strip()
    marker = tmp_path / "external-diff-ran"
    with open(repo / ".git" / "config", "a") as fh:
        fh.write(f"[diff]\n\tnoprefix = true\n\tmnemonicPrefix = true\n\texternal = touch {marker}\n")
    (repo / "mod.py").write_text("new\n")
    (repo / "tests").mkdir()
    (repo / "tests" / "conftest.py").write_text("import pytest\n")
    res = subprocess.run(["bash", "-c", container_diff_command(base)], cwd=repo, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert "diff --git a/mod.py b/mod.py" in res.stdout and "+++ b/tests/conftest.py" in res.stdout
    assert not marker.exists()
    # The agent's own index is untouched (a throwaway index was used).
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, env=env).stdout
    assert " M mod.py" in status and "?? tests/" in status
