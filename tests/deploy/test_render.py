"""`turnstile deploy render`: golden manifests of the two example specs, every object valid for a
pinned Kubernetes version (kubernetes-validate's bundled schemas, offline; KEDA's objects against
the schema vendored from KEDA's CRDs in deploy/schemas/), the deployment's invariants asserted
object by object, and bad specs refused naming the field.

Golden files are regenerated with
`.venv/bin/turnstile deploy render --config deploy/examples/NAME.yaml --out tests/deploy/golden/NAME`
(review the diff: it is the change a cluster would see).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from app.cli import main as cli_main
from app.config import ROOT
from app.deploy.render import render
from app.deploy.spec import GRACE_MARGIN_S, SpecError, load_spec

KUBERNETES_VERSION = "1.33.0"  # the oldest release still in upstream support when this was written
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))
GOLDEN = Path(__file__).parent / "golden"
SCHEMAS = ROOT / "deploy" / "schemas"


def _objects(example: Path) -> list[dict]:
    return render(load_spec(example))


def _closed(schema):
    """The schema with `additionalProperties: false` wherever it lists properties, so an unknown
    (misspelled) field fails as the API server's strict field validation would reject it
    (a CRD's structural schema prunes unknown fields silently instead)."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def _keda_validator(kind: str) -> jsonschema.Draft7Validator:
    schema = json.loads((SCHEMAS / f"{kind.lower()}-keda-v1alpha1.json").read_text())
    schema = _closed(schema)
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta is checked by the API server, not the CRD
    return jsonschema.Draft7Validator(schema)


def validate(obj: dict) -> None:
    if obj["apiVersion"].startswith("keda.sh/"):
        _keda_validator(obj["kind"]).validate(obj)
    else:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_examples_are_there():
    assert [p.stem for p in EXAMPLES] == ["cluster", "small"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_rendered_manifests_match_the_golden_files(example, tmp_path, capsys):
    """Through the CLI's parser and handler (`turnstile deploy render`, in this process: a
    subprocess costs seconds of interpreter start); byte for byte against tests/deploy/golden/."""
    out = tmp_path / "out"
    assert cli_main(["deploy", "render", "--config", str(example), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted(p.name for p in (GOLDEN / example.stem).iterdir())
    assert sorted(Path(line).name for line in printed) == written
    for name in written:
        assert (out / name).read_text() == (GOLDEN / example.stem / name).read_text(), name


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_object_is_valid_for_the_pinned_kubernetes_and_keda(example):
    objs = _objects(example)
    kinds = {o["kind"] for o in objs}
    assert {"ScaledObject", "TriggerAuthentication", "StatefulSet", "Deployment", "NetworkPolicy"} <= kinds
    for obj in objs:
        validate(obj)


def test_the_validation_can_fail():
    """A misspelled field inside a Deployment and inside a ScaledObject are both errors."""
    objs = _objects(EXAMPLES[0])
    deployment = copy.deepcopy(next(o for o in objs if o["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    scaled = copy.deepcopy(next(o for o in objs if o["kind"] == "ScaledObject"))
    scaled["spec"]["maxReplicas"] = 3
    with pytest.raises(jsonschema.ValidationError, match="maxReplicas"):
        validate(scaled)
    scaled = copy.deepcopy(next(o for o in objs if o["kind"] == "ScaledObject"))
    scaled["spec"]["pollingInterval"] = "fifteen"
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)


def _by(objs, kind, suffix):
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix))


def _containers(obj):
    return obj["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_the_deployment_invariants(example):
    spec = load_spec(example)
    objs = render(spec)
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    p = spec.name
    # Deployments for api, gateway and each worker group; StatefulSets for engine and trainer.
    for component in ("api", "gateway", *(f"worker-{g}" for g in spec.workers)):
        assert ("Deployment", f"{p}-{component}") in names
    for component in ("engine", "trainer"):
        assert ("StatefulSet", f"{p}-{component}") in names
    trainer_svc = _by(objs, "Service", "-trainer")
    assert trainer_svc["spec"]["clusterIP"] == "None"
    assert _by(objs, "StatefulSet", "-trainer")["spec"]["serviceName"] == trainer_svc["metadata"]["name"]
    # Secrets by reference only: no Secret object, every secret variable a secretKeyRef.
    assert not any(o["kind"] == "Secret" for o in objs)
    config = _by(objs, "ConfigMap", "-config")["data"]
    for var in ("DATABASE_URL", "REDIS_URL", "TURNSTILE_API_TOKEN"):
        assert var not in config
    for obj in objs:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            for c in _containers(obj):
                refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}
                assert set(refs) == {"DATABASE_URL", "REDIS_URL", "TURNSTILE_API_TOKEN"}
                assert {r["name"] for r in refs.values()} == {spec.secrets.name}
                assert not any("value" in e for e in c["env"] if e["name"] in refs)
    assert _by(objs, "PersistentVolumeClaim", "-checkpoints")
    # GPU pods: limits, tolerations, nodeSelector; CPU pods ask for no GPU.
    for obj in objs:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = obj["spec"]["template"]["spec"]
        gpus = [c["resources"]["limits"].get("nvidia.com/gpu", 0) for c in pod["containers"]]
        if obj["kind"] == "StatefulSet":
            part = getattr(spec, obj["metadata"]["labels"]["app.kubernetes.io/component"])
            pool = spec.gpu_pools[part.gpu_pool]
            assert gpus == [part.resources.gpus] and gpus[0] >= 1
            assert pod["nodeSelector"] == pool.node_selector and len(pod["tolerations"]) == len(pool.tolerations)
        else:
            assert gpus == [0] * len(gpus) and "tolerations" not in pod
    # Worker pods outlive an episode on SIGTERM; rollout consumes its own pod's queue beside prepare.
    for group, worker in spec.workers.items():
        dep = _by(objs, "Deployment", f"-worker-{group}")
        assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= spec.episode_timeout_s + GRACE_MARGIN_S
        queues = {c["name"]: c["args"][c["args"].index("-Q") + 1] for c in _containers(dep)}
        if "rollout" in queues:
            assert queues["rollout"] == "rollout" and queues["prepare"] == "prepare"
            for c in _containers(dep):  # both name the pod as their host: prepare stamps it, rollout serves it
                (host,) = [e for e in c["env"] if e["name"] == "TURNSTILE_HOST_NAME"]
                assert host["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
            mounts = {c["name"]: c["volumeMounts"][0]["name"] for c in _containers(dep)}
            assert mounts["rollout"] == mounts["prepare"]  # the prepared runtimes' disk
    # NetworkPolicy: rollout and grade pods reach the gateway, DNS and the listed outside addresses only.
    policy = _by(objs, "NetworkPolicy", "-rollout-egress")
    assert policy["spec"]["policyTypes"] == ["Egress"]
    selected = policy["spec"]["podSelector"]["matchExpressions"][1]["values"]
    pods = {"-".join(w.queues) for w in spec.workers.values()}
    assert set(selected) == {q for q in pods if "rollout" in q or "grade" in q}
    rules = policy["spec"]["egress"]
    assert rules[0]["to"] == [{"podSelector": {"matchLabels": _by(objs, "Service", "-gateway")["spec"]["selector"]}}]
    assert rules[0]["ports"] == [{"protocol": "TCP", "port": 8100}]
    assert {p["port"] for p in rules[1]["ports"]} == {53}
    assert [r["to"][0]["ipBlock"]["cidr"] for r in rules[2:]] == [e.cidr for e in spec.egress]
    # KEDA: one ScaledObject per CPU worker group with stage work, PostgreSQL over the lease table.
    scaled = {o["spec"]["scaleTargetRef"]["name"]: o for o in objs if o["kind"] == "ScaledObject"}
    assert set(scaled) == {f"{p}-worker-{g}" for g, w in spec.workers.items() if set(w.queues) - {"control"}}
    for group, worker in spec.workers.items():
        so = scaled.get(f"{p}-worker-{group}")
        if so is None:
            continue
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "postgresql" and "FROM episodes WHERE status IN" in trigger["metadata"]["query"]
        per_pod = sum(worker.concurrency_of(q) for q in worker.queues)
        assert int(trigger["metadata"]["targetQueryValue"]) == per_pod
        assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (worker.min_replicas, worker.max_replicas)
        auth = _by(objs, "TriggerAuthentication", "-scaler")
        assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
        assert auth["spec"]["secretTargetRef"][0]["key"] == spec.secrets.scaler_connection_key


def _spec_file(tmp_path, change) -> Path:
    data = yaml.safe_load(EXAMPLES[1].read_text())  # small.yaml
    change(data)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("change, message", [
    (lambda d: d["workers"]["rollout"].update(concurrencyy={"rollout": 4}),
     "workers.rollout.concurrencyy: Extra inputs are not permitted"),
    (lambda d: d.update(episode_timout_s=60), "episode_timout_s: Extra inputs are not permitted"),
    (lambda d: d["workers"]["grade"]["resources"].update(gpus=1),
     "workers.grade.resources.gpus: 1 GPUs asked for the CPU queue(s) grade"),
    (lambda d: d["workers"]["rollout"].update(queues=["rollout"]),
     "workers.rollout.queues: a group serving rollout also serves prepare"),
    (lambda d: d["workers"]["grade"].update(termination_grace_s=600),
     "workers.grade.termination_grace_s: 600 s is below the episode timeout 1200 s + 60 s"),
    (lambda d: d["workers"].pop("grade"), "workers: no group serves grade"),
    (lambda d: d["engine"].update(gpu_pool="a100"), "engine.gpu_pool: 'a100' is not in gpu_pools (gpu)"),
    (lambda d: d["workers"]["rollout"].update(queues=["prepare", "rollout", "gpu"]),
     "workers.rollout.queues.2: Input should be 'control', 'prepare', 'rollout' or 'grade'"),
])
def test_a_bad_spec_is_refused_naming_the_field(tmp_path, capsys, change, message):
    path = _spec_file(tmp_path, change)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert message in str(err.value)
    out = tmp_path / "out"
    assert cli_main(["deploy", "render", "--config", str(path), "--out", str(out)]) == 1
    assert message in capsys.readouterr().err
    assert not out.exists()  # nothing written


@pytest.mark.parametrize("cpu,workers", [("4", 4), ("1.5", 1), ("500m", 1), ("2500m", 2), ("16", 16)])
def test_a_gateway_pod_runs_a_worker_per_whole_core_it_asks_for(tmp_path, cpu, workers):
    """A gateway worker uses at most one core (one gevent thread, or gthread's threads under one
    GIL), so the pod's CPU request sets TURNSTILE_GATEWAY_WORKERS."""
    spec = load_spec(_spec_file(tmp_path, lambda d: d.setdefault("gateway", {}).update(resources={"cpu": cpu})))
    (c,) = _containers(_by(render(spec), "Deployment", "-gateway"))
    assert {"name": "TURNSTILE_GATEWAY_WORKERS", "value": str(workers)} in c["env"]


def test_the_spec_env_sets_the_gateway_workers_over_the_cpu_request(tmp_path):
    def change(d):
        d.setdefault("gateway", {}).update(resources={"cpu": "8"})
        d.setdefault("env", {})["TURNSTILE_GATEWAY_WORKERS"] = "3"
    objs = render(load_spec(_spec_file(tmp_path, change)))
    (c,) = _containers(_by(objs, "Deployment", "-gateway"))
    assert not any(e["name"] == "TURNSTILE_GATEWAY_WORKERS" for e in c["env"])  # a container's env would win
    assert _by(objs, "ConfigMap", "-config")["data"]["TURNSTILE_GATEWAY_WORKERS"] == "3"
