"""Which runtime an episode or a grade gets: a run's `runtime` setting and the instance's image.

`runtime_kind("auto", record)` is "oci" when the record names an image (`record.image`), else
"local"; any other setting is taken as given.  `prepare_runtime` builds that kind with the
harness's host tools mounted the way that kind needs them (`HarnessMounts`), and returns the
runtime; `attach_runtime` (package level) re-opens any kind from its state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.runtimes.docker import DockerRuntime
from app.runtimes.errors import RuntimeSetupError
from app.runtimes.local import LocalRuntime
from app.runtimes.oci import OciRuntime


@dataclass(frozen=True)
class HarnessMounts:
    """What a harness needs mounted, per runtime kind (from its preset in `app.harnesses`).

    `tools_dir`: the install folder (local runtimes mount it at its own path);
    `image_binds`: (host, inside) read-only mounts for image runtimes; `image_programs`: host
    executables among them that must run on the image's C library; `name`: the harness, for errors.
    """

    name: str = ""
    tools_dir: Path | None = None
    image_binds: list[tuple[str, str]] = field(default_factory=list)
    image_programs: list[Path] = field(default_factory=list)


def record_image(record: Any) -> str:
    """The instance's image reference ("" when it has none); a dict or an `InstanceRecord`."""
    value = record.get("image") if isinstance(record, dict) else getattr(record, "image", "")
    return str(value or "")


def runtime_kind(requested: str, record: Any) -> str:
    """The runtime kind for `record` under the run's `runtime` setting (auto | local | oci | docker | podman)."""
    if requested == "auto":
        return "oci" if record_image(record) else "local"
    if requested not in ("local", "oci", "docker", "podman"):
        raise ValueError(f"runtime must be auto, local, oci, docker or podman, not {requested!r}")
    return requested


def prepare_runtime(record: Any, requested: str, mounts: HarnessMounts | None = None, *,
                    purpose: str = "episode") -> "LocalRuntime | OciRuntime | DockerRuntime":
    """Prepare the runtime `runtime_kind(requested, record)` names.

    Raises `RuntimeSetupError` (stage "image" when an image kind is asked for an instance that
    names none, else the kind's own stages).
    """
    mounts = mounts or HarnessMounts()
    kind = runtime_kind(requested, record)
    if kind == "local":
        binds = [(mounts.tools_dir, str(mounts.tools_dir))] if mounts.tools_dir else []
        return LocalRuntime.prepare(record, ro_binds=binds, purpose=purpose)
    if not record_image(record):
        instance = record.get("instance_id") if isinstance(record, dict) else getattr(record, "instance_id", "?")
        raise RuntimeSetupError("image", f"runtime {kind!r} needs an image, and instance {instance} names none")
    if kind == "oci":
        return OciRuntime.prepare(record, ro_binds=mounts.image_binds, programs=mounts.image_programs,
                                  harness=mounts.name or None, purpose=purpose)
    return DockerRuntime.prepare(record, engine=kind)
