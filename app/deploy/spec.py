"""The deployment spec: what `turnstile deploy render` turns into Kubernetes manifests.

One YAML (or JSON) file, validated by pydantic with `extra="forbid"` at every level, so a
misspelled field is an error naming it instead of a default silently used.  The spec says
what differs between clusters (image, sizes, GPU pools, secret names, replica bounds); the
renderer (`app.deploy.render`) holds what Turnstile needs everywhere (commands, ports, probes,
the network policy, the autoscaling query).

Rules the spec enforces (each a `ValueError` naming the field):

* CPU worker groups serve only CPU queues (`control`, `prepare`, `rollout`, `grade`) and ask for
  no GPUs: GPUs belong to the engine and trainer pools;
* a worker group that serves `rollout` also serves `prepare`: a prepared runtime lives on the
  disk of the pod that prepared it, and its rollout is routed to that pod's own queue
  (`rollout.<pod name>`), so the two run side by side in one pod;
* every CPU queue is served by exactly one worker group;
* `termination_grace_s` of a worker group is at least the episode timeout + 60 s (Celery's warm
  shutdown lets a running episode finish before the pod goes);
* the engine and trainer name a GPU pool that the spec defines.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CPU_QUEUES = ("control", "prepare", "rollout", "grade")
GRACE_MARGIN_S = 60  # seconds above the episode timeout a worker pod gets to finish on SIGTERM

Name = Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=40)]
Quantity = Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)?(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpecError(ValueError):
    """The deploy spec is invalid; the message names the field (`workers.grade.resources.gpus: …`)."""


class Image(Strict):
    repository: str = Field(min_length=1, description="image holding the Turnstile checkout and its .venv")
    tag: str = Field(min_length=1)
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"

    @property
    def ref(self) -> str:
        return f"{self.repository}:{self.tag}"


class Secrets(Strict):
    """Names of an existing Secret and its keys.  Manifests reference them; values never appear."""

    name: Name = "turnstile"
    api_token_key: str = "api-token"
    database_url_key: str = Field("database-url", description="SQLAlchemy URL, postgresql+psycopg://…")
    redis_url_key: str = "redis-url"
    scaler_connection_key: str = Field(
        "scaler-connection", description="libpq URL (postgresql://user:pass@host/db) the KEDA scaler reads")


class Resources(Strict):
    cpu: Quantity = "1"
    memory: Quantity = "2Gi"
    gpus: int = Field(0, ge=0, le=16)


class Toleration(Strict):
    key: str = Field(min_length=1)
    operator: Literal["Exists", "Equal"] = "Exists"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"


class GpuPool(Strict):
    """Nodes with accelerators: how a GPU pod lands there and which resource it asks for."""

    node_selector: dict[str, str] = Field(min_length=1)
    tolerations: list[Toleration] = Field(min_length=1)
    resource: str = Field("nvidia.com/gpu", pattern=r"^[a-z0-9.-]+/[a-z0-9.-]+$")


class Service(Strict):
    """A stateless HTTP process (api, gateway)."""

    replicas: int = Field(1, ge=1, le=100)
    resources: Resources = Resources()


class Worker(Strict):
    """A group of Celery queues served by one Deployment (one container per queue, one pod)."""

    queues: list[Literal["control", "prepare", "rollout", "grade"]] = Field(min_length=1)
    concurrency: dict[str, int] = Field(default_factory=dict,
                                        description="Celery processes per queue (default 2; rollout 8)")
    min_replicas: int = Field(1, ge=0, le=1000)
    max_replicas: int = Field(1, ge=1, le=1000)
    resources: Resources = Resources()
    termination_grace_s: int | None = Field(None, ge=1, description="default: episode timeout + 60")
    runtimes_size: Quantity = Field("50Gi", description="the pod's own disk for prepared runtimes (emptyDir)")

    def concurrency_of(self, queue: str) -> int:
        return self.concurrency.get(queue, 8 if queue == "rollout" else 2)


class Engine(Strict):
    """vLLM engines on the GPU pool: a StatefulSet (stable names, listed in TURNSTILE_ENGINE_URLS)."""

    replicas: int = Field(1, ge=1, le=64)
    model: str = Field(min_length=1, description="Hugging Face id or a path in the image")
    gpu_pool: Name
    resources: Resources = Resources(cpu="8", memory="64Gi", gpus=1)
    max_model_len: int = Field(8192, ge=256)
    tool_call_parser: str = "hermes"


class Trainer(Strict):
    """The gpu worker under torchrun (FSDP2): a StatefulSet of `nodes` pods, one per machine."""

    nodes: int = Field(1, ge=1, le=64)
    gpu_pool: Name
    resources: Resources = Resources(cpu="16", memory="256Gi", gpus=8)
    rendezvous_port: int = Field(29500, ge=1024, le=65535)


class Egress(Strict):
    """An address outside the cluster the worker pods must reach (the database, Redis, a package mirror)."""

    what: str = Field(min_length=1, description="what it is, for the reader")
    cidr: str = Field(pattern=r"^[0-9]{1,3}(\.[0-9]{1,3}){3}/[0-9]{1,2}$")
    port: int = Field(ge=1, le=65535)


class Checkpoints(Strict):
    size: Quantity = "500Gi"
    storage_class: str | None = None
    access_mode: Literal["ReadWriteOnce", "ReadWriteMany"] = "ReadWriteMany"


class DeploySpec(Strict):
    """The whole deployment (`deploy/examples/*.yaml`)."""

    name: Name = "turnstile"
    namespace: Name = "turnstile"
    image: Image
    secrets: Secrets = Secrets()
    episode_timeout_s: int = Field(1800, ge=1, description="agent + grading budget of one episode, seconds")
    env: dict[str, str] = Field(default_factory=dict, description="extra settings for every process (ConfigMap)")
    api: Service = Service()
    gateway: Service = Service(replicas=2)
    workers: dict[Name, Worker]
    gpu_pools: dict[Name, GpuPool]
    engine: Engine
    trainer: Trainer
    checkpoints: Checkpoints = Checkpoints()
    egress: list[Egress] = Field(default_factory=list,
                                 description="outside addresses rollout and grade pods may reach besides the gateway")

    @model_validator(mode="after")
    def _rules(self) -> "DeploySpec":
        served: dict[str, str] = {}
        for name, worker in self.workers.items():
            where = f"workers.{name}"
            if worker.resources.gpus:
                raise ValueError(f"{where}.resources.gpus: {worker.resources.gpus} GPUs asked for the CPU "
                                 f"queue(s) {', '.join(worker.queues)}; GPUs go to engine and trainer")
            if "rollout" in worker.queues and "prepare" not in worker.queues:
                raise ValueError(f"{where}.queues: a group serving rollout also serves prepare (a prepared "
                                 "runtime is on the disk of the pod that prepared it)")
            unknown = set(worker.concurrency) - set(worker.queues)
            if unknown:
                raise ValueError(f"{where}.concurrency: {', '.join(sorted(unknown))} not among its queues")
            if any(n < 1 for n in worker.concurrency.values()):
                raise ValueError(f"{where}.concurrency: each value must be at least 1")
            if worker.max_replicas < worker.min_replicas:
                raise ValueError(f"{where}.max_replicas: below min_replicas ({worker.min_replicas})")
            if not set(worker.queues) - {"control"} and worker.min_replicas < 1:
                raise ValueError(f"{where}.min_replicas: a group KEDA does not scale (control only) needs at least 1")
            grace = self.grace_of(worker)
            if grace < self.episode_timeout_s + GRACE_MARGIN_S:
                raise ValueError(f"{where}.termination_grace_s: {grace} s is below the episode timeout "
                                 f"{self.episode_timeout_s} s + {GRACE_MARGIN_S} s")
            for queue in worker.queues:
                if queue in served:
                    raise ValueError(f"{where}.queues: {queue} is already served by workers.{served[queue]}")
                served[queue] = name
        missing = [q for q in CPU_QUEUES if q not in served]
        if missing:
            raise ValueError(f"workers: no group serves {', '.join(missing)}")
        for part in ("engine", "trainer"):
            pool = getattr(self, part).gpu_pool
            if pool not in self.gpu_pools:
                raise ValueError(f"{part}.gpu_pool: {pool!r} is not in gpu_pools ({', '.join(self.gpu_pools)})")
            if getattr(self, part).resources.gpus < 1:
                raise ValueError(f"{part}.resources.gpus: a GPU pod needs at least one GPU")
        return self

    def grace_of(self, worker: Worker) -> int:
        """Seconds a worker pod gets between SIGTERM and SIGKILL."""
        return worker.termination_grace_s or self.episode_timeout_s + GRACE_MARGIN_S


def _where(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if not re.fullmatch(r"function-after\[.*\]", str(p))) or "spec"


def load_spec(path: str | Path) -> DeploySpec:
    """Read and validate a deploy spec file (YAML or JSON).

    Raises:
        SpecError: unreadable file, not a mapping, or any rule above; one line per problem,
            each naming its field (`workers.rollout.concurrencyy: Extra inputs are not permitted`).
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: a deploy spec is a mapping, got {type(data).__name__}")
    try:
        return DeploySpec.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            message = err["msg"].removeprefix("Value error, ")
            loc = _where(err["loc"])
            lines.append(message if loc == "spec" else f"{loc}: {message}")
        raise SpecError(f"{path}: " + "; ".join(lines)) from None
