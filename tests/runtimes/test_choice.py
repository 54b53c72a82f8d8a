"""Which runtime a run's episode gets: the `runtime` setting of a run and the instance's image."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.runconfig import RUNTIME_KINDS, RunConfig
from app.runtimes import RuntimeSetupError
from app.runtimes.choice import HarnessMounts, prepare_runtime, runtime_kind

WITH_IMAGE = {"instance_id": "a__b-1", "image": "docker://127.0.0.1:5000/swe/requests:2.27"}
WITHOUT = {"instance_id": "a__b-2", "image": ""}


def test_auto_is_the_image_when_the_instance_names_one_else_local():
    assert runtime_kind("auto", WITH_IMAGE) == "oci" and runtime_kind("auto", WITHOUT) == "local"
    assert [runtime_kind(k, WITH_IMAGE) for k in ("local", "oci", "docker", "podman")] == [
        "local", "oci", "docker", "podman"]
    with pytest.raises(ValueError, match="lxc"):
        runtime_kind("lxc", WITH_IMAGE)


def test_an_image_runtime_for_an_instance_without_an_image_is_a_clear_setup_error():
    with pytest.raises(RuntimeSetupError) as info:
        prepare_runtime(WITHOUT, "oci", HarnessMounts(name="mini-swe-agent"))
    assert info.value.stage == "image" and "a__b-2 names none" in str(info.value)


def test_run_config_validates_the_runtime_setting():
    assert RunConfig().runtime == "auto" and RUNTIME_KINDS == ("auto", "local", "oci", "docker", "podman")
    assert RunConfig.model_validate({"runtime": "oci"}).runtime == "oci"
    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate({"runtime": "kubernetes"})
    assert info.value.errors()[0]["loc"] == ("runtime",)
