"""Kubernetes manifests of a Turnstile deployment, from a `DeploySpec`.

`render(spec)` returns the objects as plain dicts in a fixed order; `write(spec, out)` writes
one YAML file per object (`<kind>-<name>.yaml`, lower case) and returns their paths.  The same
spec always gives byte-identical files (golden tests compare them).

What is rendered:

* ConfigMap `<name>-config`: the settings every process shares (addresses of api, gateway and
  engines, bind addresses, var folder) plus the spec's `env`; secrets come from the existing
  Secret by `secretKeyRef` (DATABASE_URL, REDIS_URL, TURNSTILE_API_TOKEN), never as values;
* Deployments + Services `api` (:8000) and `gateway` (:8100); a gateway pod runs one gunicorn
  worker per whole core it asks for (TURNSTILE_GATEWAY_WORKERS, unless the spec's env sets it);
* one Deployment per CPU worker group, one container per Celery queue, with the pod's name as
  TURNSTILE_HOST_NAME.  The `rollout` container also consumes `rollout.<pod name>` (app.celery):
  the pod's own queue, which receives the rollouts of the runtimes that pod's `prepare`
  container built on the pod's disk (an emptyDir both mount);
  the group's `terminationGracePeriodSeconds` covers an episode (Celery's warm shutdown on
  SIGTERM finishes the running task);
* StatefulSet + headless Service `engine`: `vllm serve` (`app.engines.vllm.serve.serve_command`)
  on the GPU pool, one stable name per replica listed in TURNSTILE_ENGINE_URLS;
* StatefulSet + headless Service `trainer`: the gpu worker, under torchrun (FSDP2) when it has
  more than one GPU or node; the headless Service gives rank 0 a stable name for the c10d
  rendezvous (`publishNotReadyAddresses`: ranks meet before any is ready);
* PVC `<name>-checkpoints`: the trainer writes checkpoints there (every rank sees it); the vLLM
  engines mount it read-only and load a checkpoint by path;
* NetworkPolicy: pods of groups serving rollout or grade send only to the gateway, the
  database and Redis (the worker's own connections) and DNS;
* KEDA: a TriggerAuthentication (the scaler's connection string from the Secret) and one
  ScaledObject per group serving prepare, rollout or grade, on the PostgreSQL scaler over the
  episodes' stage leases (`app.deploy.scaler.work_query`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from app.deploy.scaler import states_of, work_query
from app.deploy.spec import DeploySpec, Worker
from app.engines.vllm.serve import VLLMServeConfig, serve_command

VAR_DIR = "/var/lib/turnstile"
API_PORT, GATEWAY_PORT, ENGINE_PORT = 8000, 8100, 8200
PYTHON = ".venv/bin/python"
CELERY = ".venv/bin/celery"
Obj = dict[str, Any]


def _labels(spec: DeploySpec, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "turnstile", "app.kubernetes.io/instance": spec.name,
            "app.kubernetes.io/component": component}


def _meta(spec: DeploySpec, name: str, component: str) -> Obj:
    return {"name": f"{spec.name}-{name}", "namespace": spec.namespace, "labels": _labels(spec, component)}


def _resources(res, gpu_resource: str | None = None) -> Obj:
    out: Obj = {"requests": {"cpu": res.cpu, "memory": res.memory}, "limits": {"memory": res.memory}}
    if res.gpus and gpu_resource:
        out["limits"][gpu_resource] = res.gpus
    return out


def _env(spec: DeploySpec) -> list[Obj]:
    """Container env: the ConfigMap for settings, the Secret by key for secrets."""
    s = spec.secrets
    return [{"name": var, "valueFrom": {"secretKeyRef": {"name": s.name, "key": key}}}
            for var, key in (("DATABASE_URL", s.database_url_key), ("REDIS_URL", s.redis_url_key),
                             ("TURNSTILE_API_TOKEN", s.api_token_key))]


def _env_from(spec: DeploySpec) -> list[Obj]:
    return [{"configMapRef": {"name": f"{spec.name}-config"}}]


def engine_urls(spec: DeploySpec) -> list[str]:
    """Stable URLs of the engine replicas (StatefulSet pod names through the headless Service)."""
    svc = f"{spec.name}-engine"
    return [f"http://{svc}-{i}.{svc}.{spec.namespace}.svc:{ENGINE_PORT}" for i in range(spec.engine.replicas)]


def config_map(spec: DeploySpec) -> Obj:
    host = f"{spec.namespace}.svc"
    data = {
        "TURNSTILE_VAR_DIR": VAR_DIR,
        "TURNSTILE_API_URL": f"http://{spec.name}-api.{host}:{API_PORT}",
        "TURNSTILE_API_BIND": f"0.0.0.0:{API_PORT}",
        "TURNSTILE_GATEWAY_URL": f"http://{spec.name}-gateway.{host}:{GATEWAY_PORT}",
        "TURNSTILE_GATEWAY_BIND": f"0.0.0.0:{GATEWAY_PORT}",
        "TURNSTILE_ENGINE_URLS": ",".join(engine_urls(spec)),
        "TURNSTILE_ENGINE_MODEL": spec.engine.model,
        **spec.env,
    }
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(spec, "config", "config"),
            "data": dict(sorted(data.items()))}


def checkpoints_pvc(spec: DeploySpec) -> Obj:
    pvc: Obj = {"accessModes": [spec.checkpoints.access_mode],
                "resources": {"requests": {"storage": spec.checkpoints.size}}}
    if spec.checkpoints.storage_class:
        pvc["storageClassName"] = spec.checkpoints.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _meta(spec, "checkpoints", "checkpoints"), "spec": pvc}


def _service(spec: DeploySpec, component: str, port: int, *, headless: bool = False) -> Obj:
    body: Obj = {"selector": _labels(spec, component),
                 "ports": [{"name": "http" if port != spec.trainer.rendezvous_port else "rendezvous",
                            "port": port, "targetPort": port, "protocol": "TCP"}]}
    if headless:
        body["clusterIP"] = "None"
        body["publishNotReadyAddresses"] = True
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, component, component), "spec": body}


def _pod(spec: DeploySpec, component: str, containers: list[Obj], **extra: Any) -> Obj:
    return {"metadata": {"labels": _labels(spec, component)},
            "spec": {"containers": containers, **extra}}


def _container(spec: DeploySpec, name: str, args: list[str], resources: Obj, **extra: Any) -> Obj:
    return {"name": name, "image": spec.image.ref, "imagePullPolicy": spec.image.pull_policy,
            "workingDir": "/opt/turnstile", "command": [args[0]], "args": args[1:],
            "env": _env(spec) + extra.pop("env", []), "envFrom": _env_from(spec),
            "resources": resources, **extra}


def _deployment(spec: DeploySpec, component: str, replicas: int, pod: Obj) -> Obj:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(spec, component, component),
            "spec": {"replicas": replicas, "selector": {"matchLabels": _labels(spec, component)}, "template": pod}}


def _http_probe(path: str, port: int) -> Obj:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": 10, "failureThreshold": 6}


def api(spec: DeploySpec) -> list[Obj]:
    c = _container(spec, "api", [PYTHON, "-m", "workers.launch", ".venv/bin/gunicorn", "-c", "workers/api_conf.py",
                                 "app:create_app()"], _resources(spec.api.resources),
                   ports=[{"containerPort": API_PORT, "name": "http"}],
                   readinessProbe=_http_probe("/api/health", API_PORT))
    return [_deployment(spec, "api", spec.api.replicas, _pod(spec, "api", [c])),
            _service(spec, "api", API_PORT)]


# Kubernetes quantity suffixes (https://kubernetes.io/docs/reference/kubernetes-api/common-definitions/quantity/).
_SUFFIX = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def gateway_workers(cpu: str) -> int:
    """gunicorn worker processes for a gateway pod that asks for `cpu` (a Kubernetes quantity:
    "4", "1.5", "500m"): one per whole core, at least one.  A gateway worker uses at most one core
    (a gevent worker is one OS thread; a gthread worker's threads share one GIL), and relaying
    streamed tokens is CPU-bound (bench/gateway.py --token-rate), so fewer workers than cores
    leave the pod's cores idle while its streams wait."""
    number = cpu.rstrip("mkKMGTi")
    return max(1, int(float(number) * _SUFFIX[cpu[len(number):]]))


def gateway(spec: DeploySpec) -> list[Obj]:
    # TURNSTILE_GATEWAY_WORKERS follows the pod's CPU request unless the spec's env sets it (a
    # container's own env would win over the ConfigMap that carries the spec's env).
    env = ([] if "TURNSTILE_GATEWAY_WORKERS" in spec.env else
           [{"name": "TURNSTILE_GATEWAY_WORKERS", "value": str(gateway_workers(spec.gateway.resources.cpu))}])
    c = _container(spec, "gateway", [PYTHON, "-m", "workers.launch", ".venv/bin/gunicorn", "-c",
                                     "workers/gateway_conf.py", "app.proxy:create_gateway_app()"],
                   _resources(spec.gateway.resources), ports=[{"containerPort": GATEWAY_PORT, "name": "http"}],
                   readinessProbe={"tcpSocket": {"port": GATEWAY_PORT}, "periodSeconds": 10}, env=env)
    return [_deployment(spec, "gateway", spec.gateway.replicas, _pod(spec, "gateway", [c])),
            _service(spec, "gateway", GATEWAY_PORT)]


def celery_args(queue: str, concurrency: int) -> list[str]:
    """`celery worker` argv of one queue's container (the Procfile's worker options).  A worker of
    `rollout` adds its machine's own queue itself (`app.celery`, from TURNSTILE_HOST_NAME)."""
    return [CELERY, "-A", "app", "worker", "-Q", queue, "-c", str(concurrency), "-n", f"{queue}@%h", "-O", "fair",
            "--without-gossip", "--without-mingle", "--loglevel", "INFO"]


def worker_group(spec: DeploySpec, group: str, worker: Worker) -> Obj:
    pod_name = {"name": "TURNSTILE_HOST_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    containers = [
        _container(spec, queue, celery_args(queue, worker.concurrency_of(queue)), _resources(worker.resources),
                   env=[pod_name], volumeMounts=[{"name": "var", "mountPath": VAR_DIR}])
        for queue in worker.queues
    ]
    pod = _pod(spec, f"worker-{group}", containers,
               terminationGracePeriodSeconds=spec.grace_of(worker),
               volumes=[{"name": "var", "emptyDir": {"sizeLimit": worker.runtimes_size}}])
    pod["metadata"]["labels"]["turnstile.dev/queues"] = "-".join(worker.queues)
    return _deployment(spec, f"worker-{group}", worker.min_replicas or 0, pod)


def _gpu_scheduling(spec: DeploySpec, pool_name: str) -> Obj:
    pool = spec.gpu_pools[pool_name]
    return {"nodeSelector": dict(pool.node_selector),
            "tolerations": [t.model_dump(exclude_none=True) for t in pool.tolerations]}


def _statefulset(spec: DeploySpec, component: str, replicas: int, pod: Obj) -> Obj:
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(spec, component, component),
            "spec": {"serviceName": f"{spec.name}-{component}", "replicas": replicas,
                     "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": _labels(spec, component)}, "template": pod}}


def _checkpoints_volume(spec: DeploySpec, read_only: bool) -> Obj:
    return {"name": "checkpoints", "persistentVolumeClaim": {"claimName": f"{spec.name}-checkpoints",
                                                               "readOnly": read_only}}


def engine(spec: DeploySpec) -> list[Obj]:
    e = spec.engine
    argv, env = serve_command(VLLMServeConfig(model=e.model, host="0.0.0.0", port=ENGINE_PORT,
                                              max_model_len=e.max_model_len, tool_call_parser=e.tool_call_parser,
                                              extra_args=["--tensor-parallel-size", str(e.resources.gpus)]))
    pool = spec.gpu_pools[e.gpu_pool]
    c = _container(spec, "vllm", [".venv/bin/" + argv[0], *argv[1:]], _resources(e.resources, pool.resource),
                   env=[{"name": k, "value": v} for k, v in sorted(env.items())],
                   ports=[{"containerPort": ENGINE_PORT, "name": "http"}],
                   readinessProbe=_http_probe("/health", ENGINE_PORT),
                   volumeMounts=[{"name": "checkpoints", "mountPath": f"{VAR_DIR}/runs", "readOnly": True}])
    pod = _pod(spec, "engine", [c], volumes=[_checkpoints_volume(spec, True)], **_gpu_scheduling(spec, e.gpu_pool))
    return [_statefulset(spec, "engine", e.replicas, pod), _service(spec, "engine", ENGINE_PORT, headless=True)]


def trainer_args(spec: DeploySpec) -> list[str]:
    """The gpu worker's argv: `workers.gpu_worker` for one GPU on one node, else torchrun (FSDP2)
    with the c10d rendezvous at rank 0's stable name."""
    t = spec.trainer
    if t.nodes == 1 and t.resources.gpus == 1:
        return [PYTHON, "-m", "workers.gpu_worker", "--loglevel", "INFO"]
    rdzv = f"{spec.name}-trainer-0.{spec.name}-trainer.{spec.namespace}.svc:{t.rendezvous_port}"
    return [".venv/bin/torchrun", "--nnodes", str(t.nodes), "--node-rank", "$(NODE_RANK)",
            "--nproc-per-node", str(t.resources.gpus), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv,
            "-m", "workers.gpu_torchrun", "--loglevel", "INFO"]


def trainer(spec: DeploySpec) -> list[Obj]:
    t = spec.trainer
    pool = spec.gpu_pools[t.gpu_pool]
    rank = {"name": "NODE_RANK",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}}
    c = _container(spec, "gpu", trainer_args(spec), _resources(t.resources, pool.resource), env=[rank],
                   ports=[{"containerPort": t.rendezvous_port, "name": "rendezvous"}],
                   volumeMounts=[{"name": "checkpoints", "mountPath": f"{VAR_DIR}/runs"},
                                 {"name": "shm", "mountPath": "/dev/shm"}])
    pod = _pod(spec, "trainer", [c], volumes=[_checkpoints_volume(spec, False),
                                             {"name": "shm", "emptyDir": {"medium": "Memory"}}],
               **_gpu_scheduling(spec, t.gpu_pool))
    return [_statefulset(spec, "trainer", t.nodes, pod),
            _service(spec, "trainer", t.rendezvous_port, headless=True)]


def network_policy(spec: DeploySpec) -> Obj:
    """Egress of the pods serving rollout or grade: the gateway, DNS, and the worker's own
    database and Redis (addresses outside the cluster are listed in `spec.egress_cidrs`)."""
    groups = ["-".join(w.queues) for w in spec.workers.values() if {"rollout", "grade"} & set(w.queues)]
    selector = {"matchExpressions": [
        {"key": "app.kubernetes.io/instance", "operator": "In", "values": [spec.name]},
        {"key": "turnstile.dev/queues", "operator": "In", "values": sorted(groups)}]}
    egress: list[Obj] = [
        {"to": [{"podSelector": {"matchLabels": _labels(spec, "gateway")}}],
         "ports": [{"protocol": "TCP", "port": GATEWAY_PORT}]},
        {"to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
         "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
    ]
    for dest in spec.egress:
        egress.append({"to": [{"ipBlock": {"cidr": dest.cidr}}], "ports": [{"protocol": "TCP", "port": dest.port}]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(spec, "rollout-egress", "network-policy"),
            "spec": {"podSelector": selector, "policyTypes": ["Egress"], "egress": egress}}


def trigger_authentication(spec: DeploySpec) -> Obj:
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "TriggerAuthentication",
            "metadata": _meta(spec, "scaler", "autoscaling"),
            "spec": {"secretTargetRef": [{"parameter": "connection", "name": spec.secrets.name,
                                          "key": spec.secrets.scaler_connection_key}]}}


def scaled_object(spec: DeploySpec, group: str, worker: Worker) -> Obj:
    """Replicas = ceil(episodes queued + leased for the group's queues / its processes per pod)."""
    per_pod = sum(worker.concurrency_of(q) for q in worker.queues if states_of([q]))
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
            "metadata": _meta(spec, f"worker-{group}", "autoscaling"),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": f"{spec.name}-worker-{group}"},
                     "minReplicaCount": worker.min_replicas, "maxReplicaCount": worker.max_replicas,
                     "pollingInterval": 15, "cooldownPeriod": 300,
                     "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                         "scaleDown": {"stabilizationWindowSeconds": 300}}}},
                     "triggers": [{"type": "postgresql", "name": "queued-and-leased",
                                   "metadata": {"query": work_query(worker.queues),
                                                "targetQueryValue": str(per_pod),
                                                "activationTargetQueryValue": "0"},
                                   "authenticationRef": {"name": f"{spec.name}-scaler"}}]}}


def render(spec: DeploySpec) -> list[Obj]:
    """Every object of the deployment, in apply order (config first, autoscaling last)."""
    objs: list[Obj] = [config_map(spec), checkpoints_pvc(spec), *api(spec), *gateway(spec)]
    objs += [worker_group(spec, g, w) for g, w in spec.workers.items()]
    objs += [*engine(spec), *trainer(spec), network_policy(spec), trigger_authentication(spec)]
    objs += [scaled_object(spec, g, w) for g, w in spec.workers.items() if states_of(w.queues)]
    return objs


def file_name(obj: Obj) -> str:
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def dump(obj: Obj) -> str:
    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False, width=120)


def write(spec: DeploySpec, out: str | Path) -> list[Path]:
    """Write one YAML file per object into `out` (created); returns the paths in apply order.
    Files of an earlier render that this one does not produce are left alone."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for obj in render(spec):
        path = out / file_name(obj)
        path.write_text(dump(obj))
        paths.append(path)
    return paths
