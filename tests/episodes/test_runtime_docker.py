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
