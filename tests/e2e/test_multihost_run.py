"""A train run across separate machines (mini-swe-agent, SmolLM2, 2 steps), each machine a network
namespace on a bridge with its own address and its own var folder (support.netns):

* control:  PostgreSQL (a private cluster: initdb + postgres), Redis, the REST API, beat, and the
            control-queue worker;
* gateway:  the gateway and the embedded engine (SmolLM2);
* rollout1, rollout2: prepare + grade and rollout workers;
* trainer:  the gpu worker.

No machine has 127.0.0.1 (its loopback device carries only its own address), so a process that
binds or dials 127.0.0.1 where it must reach another machine fails (and the run with it); at the
end every machine's /proc/net/tcp is read to show no 127.0.0.1 socket was left.  Nothing but the installed software (the checkout, its
.venv, the model weight cache and the harness CLIs, as an image would hold them) is shared on
disk: checkpoints reach the engine over HTTP (SHA-256 checked), and each prepared runtime is
rolled out on the machine that prepared it.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy import select

from app import config, db
from app.db import session_scope
from app.harnesses import get_preset
from app.tables import Episode, Run, TrainingStep
from support import API_TOKEN, AUTH, ROOT, wait_for
from support import netns
from support.caches import fill_runtime_caches

pytestmark = pytest.mark.slow

RUN = {"kind": "train", "harness": "mini-swe-agent", "task_set": "synthetic", "instances": ["synthetic__inflection-1"],
       "model": {"name": "smollm2"}, "group_size": 2, "tasks_per_step": 1, "steps": 2,
       "budget": {"max_turns": 2, "max_tokens": 32}, "timeouts": {"agent_s": 240, "grade_s": 300},
       "training": {"lora": True, "lora_r": 8, "lora_alpha": 16, "micro_batch_tokens": 2048}}
PY = sys.executable


def _wait_tcp(address: str, port: int, what: str, proc) -> None:
    def up():
        try:
            socket.create_connection((address, port), timeout=1).close()
            return True
        except OSError:
            return False

    wait_for(up, 180, interval=0.5, what=f"{what} at {address}:{port}\n{proc.output()[-3000:]}")


@pytest.fixture
def machines(spawn, tmp_path, monkeypatch):
    why = netns.available()
    if why:
        pytest.fail(f"the multi-host test needs network namespaces: {why}")
    if not get_preset("mini-swe-agent").is_installed():
        pytest.fail("mini-swe-agent is not installed: run `make ci-deps`")
    net = netns.Network()
    pg_dir = Path(tempfile.mkdtemp(prefix="turnstile-multihost-pg-"))
    try:
        yield from _machines(net, pg_dir, spawn, tmp_path, monkeypatch)
    finally:  # also when the setup fails: no namespace, bridge or cluster folder is left behind
        db.dispose_engine()
        config.reset_settings()
        net.close()
        shutil.rmtree(pg_dir, ignore_errors=True)


def _machines(net, pg_dir, spawn, tmp_path, monkeypatch):
    names = ("control", "gateway", "rollout1", "rollout2", "trainer")
    hosts = {name: net.add_host(name) for name in names}
    ctl, gw = hosts["control"].address, hosts["gateway"].address
    project_var = ROOT / "var"
    # The installed caches every machine shares (the checkout's, or TURNSTILE_CACHE_DIR's).  The
    # rollout machines have no route to the package index: what their prepare downloads and
    # builds is filled here first, from this test's own process, not left to an earlier test.
    cache = Path(os.environ.get("TURNSTILE_CACHE_DIR") or project_var / "cache")
    fill_runtime_caches(RUN["task_set"], RUN["instances"], cache)
    env_all = {
        "DATABASE_URL": f"postgresql+psycopg://postgres@{ctl}:5432/turnstile",
        "REDIS_URL": f"redis://{ctl}:6379/0",
        "TURNSTILE_API_TOKEN": API_TOKEN,
        "TURNSTILE_API_URL": f"http://{ctl}:8000", "TURNSTILE_API_BIND": f"{ctl}:8000",
        "TURNSTILE_GATEWAY_URL": f"http://{gw}:8100", "TURNSTILE_GATEWAY_BIND": f"{gw}:8100",
        "TURNSTILE_ENGINE_URLS": f"http://{gw}:8200",
        # the installed software every machine has (an image would hold the same)
        "TURNSTILE_CACHE_DIR": str(cache), "TURNSTILE_TOOLS_DIR": str(project_var / "tools"),
        "TURNSTILE_TASK_DIRS": tempfile.gettempdir(), "TURNSTILE_LOG_LEVEL": "INFO",
        "TURNSTILE_WATCHDOG_INTERVAL_S": "10",
    }
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TZ")}
    envs, vars_ = {}, {}
    for name in names:
        var = tmp_path / name / "var"
        var.mkdir(parents=True)
        (var / "models").symlink_to(project_var / "models")  # the weight cache: installed, read-only here
        (tmp_path / name / "home").mkdir()
        vars_[name] = var
        envs[name] = {**keep, **env_all, "TURNSTILE_VAR_DIR": str(var), "TURNSTILE_HOST_NAME": name,
                      "HOME": str(tmp_path / name / "home")}
    procs = {}

    def start(host: str, label: str, argv: list[str], **extra_env: str):
        procs[label] = spawn(hosts[host].cmd(argv), {**envs[host], **extra_env}, name=label)
        return procs[label]

    # control: a private PostgreSQL cluster (owned by the postgres user: postgres refuses root) and Redis.
    os.chmod(pg_dir, 0o755)
    shutil.chown(pg_dir, "postgres", "postgres")
    as_postgres = ["setpriv", "--reuid=postgres", "--regid=postgres", "--clear-groups"]
    subprocess.run([*as_postgres, "initdb", "-D", str(pg_dir / "data"), "-U", "postgres", "--auth=trust", "-E", "UTF8"],
                   check=True, capture_output=True, timeout=180)
    with open(pg_dir / "data" / "pg_hba.conf", "a") as hba:  # initdb trusts loopback only; here, the bridge
        hba.write(f"host all all {net.subnet}.0/24 trust\n")
    pg = start("control", "postgres", [*as_postgres, "postgres", "-D", str(pg_dir / "data"), "-c", f"listen_addresses={ctl}",
                                       "-c", f"unix_socket_directories={pg_dir}", "-c", "fsync=off"])
    redis_proc = start("control", "redis", ["redis-server", "--bind", ctl, "--port", "6379", "--save", "",
                                            "--appendonly", "no", "--protected-mode", "no",
                                            "--dir", str(vars_["control"])])
    _wait_tcp(ctl, 5432, "PostgreSQL", pg)
    _wait_tcp(ctl, 6379, "Redis", redis_proc)
    wait_for(lambda: _create_database(ctl), 60, interval=0.5, what=f"the database\n{pg.output()[-2000:]}")
    migrate = subprocess.run(hosts["control"].cmd([PY, "-m", "alembic", "upgrade", "head"]), cwd=ROOT,
                             env=envs["control"], capture_output=True, text=True, timeout=300)
    assert migrate.returncode == 0, migrate.stderr[-3000:]

    bin_dir = os.path.dirname(PY)
    start("control", "api", [f"{bin_dir}/gunicorn", "-c", "workers/api_conf.py", "app:create_app()"])
    start("control", "beat", [PY, "-m", "celery", "-A", "app", "beat", "--loglevel", "INFO"])
    start("control", "control-worker", _celery("control", 2, "control"))
    start("gateway", "engine", [PY, "-m", "app.engines.embedded.server", "--model", "smollm2", "--host", gw,
                                "--port", "8200"])
    start("gateway", "gateway", [f"{bin_dir}/gunicorn", "-c", "workers/gateway_conf.py", "app.proxy:create_gateway_app()"])
    for host in ("rollout1", "rollout2"):
        start(host, f"{host}-cpu", _celery("prepare,grade", 2, f"cpu-{host}"))
        start(host, f"{host}-rollout", _celery("rollout", 2, f"rollout-{host}"))
    start("trainer", "gpu", _celery("gpu", 1, "gpu"))

    def logs() -> str:
        return "\n".join(f"===== {label}\n{p.output()[-3000:]}" for label, p in procs.items())

    def up():
        try:
            return all(httpx.get(u, timeout=3).status_code == 200 for u in (
                f"http://{ctl}:8000/api/health", f"http://{gw}:8100/health", f"http://{gw}:8200/health"))
        except httpx.HTTPError:
            return False

    wait_for(up, 300, interval=1, what=lambda: f"the machines' servers to come up\n{logs()}")
    for key in ("DATABASE_URL", "REDIS_URL", "TURNSTILE_API_URL"):
        monkeypatch.setenv(key, env_all[key])
    config.reset_settings()
    db.dispose_engine()
    try:
        yield hosts, vars_, procs, logs
    finally:
        for proc in reversed(list(procs.values())):
            proc.kill(signal.SIGTERM)


def _celery(queues: str, concurrency: int, name: str) -> list[str]:
    return [PY, "-m", "celery", "-A", "app", "worker", "-Q", queues, "-c", str(concurrency), "-n", f"{name}@%h",
            "-O", "fair", "--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "INFO"]


def _create_database(host: str) -> bool:
    try:
        with psycopg.connect(f"postgresql://postgres@{host}:5432/postgres", autocommit=True, connect_timeout=3) as conn:
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = 'turnstile'").fetchone():
                conn.execute("CREATE DATABASE turnstile")
        return True
    except psycopg.OperationalError:
        return False


def _loopback_sockets(host: netns.Host) -> list[str]:
    """TCP sockets of the machine with a 127.0.0.1 end (local or remote), from /proc/net/tcp."""
    table = subprocess.run(host.cmd(["cat", "/proc/net/tcp"]), capture_output=True, text=True, timeout=30).stdout
    rows = [line.split() for line in table.splitlines()[1:]]
    return [" ".join(r[1:3]) for r in rows if r[1].startswith("0100007F") or r[2].startswith("0100007F")]


def test_a_train_run_completes_across_five_machines(machines):
    hosts, vars_, procs, logs = machines
    ctl, gw = hosts["control"].address, hosts["gateway"].address
    api = httpx.Client(base_url=f"http://{ctl}:8000", headers=AUTH, timeout=30)
    resp = api.post("/api/runs", json=RUN)
    assert resp.status_code == 202, resp.text
    run_id = resp.json()["id"]

    def finished():
        try:
            run = api.get(f"/api/runs/{run_id}").json()
        except httpx.TransportError:  # a gunicorn worker restarted on the loaded box: ask again
            return None
        return run if run["status"] in ("completed", "failed", "cancelled") else None

    run = wait_for(finished, 1500, interval=2, what=lambda: f"run {run_id} to finish\n{logs()}")
    assert run["status"] == "completed", (run.get("error"), logs())

    with session_scope() as s:
        assert s.get(Run, run_id).policy_version == 2
        steps = s.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id).order_by(TrainingStep.step)).all()
        assert [(t.status, t.policy_version) for t in steps] == [("completed", 1), ("completed", 2)]
        for t in steps:  # each checkpoint reached the engine over HTTP, digests checked
            assert t.metrics["engine_sync"] == {f"http://{gw}:8200": "ok"}, t.metrics["engine_sync"]
        episodes = s.scalars(select(Episode).where(Episode.run_id == run_id)).all()
        placed = {e.id: e.runtime["host"] for e in episodes}
    assert len(episodes) == 4 and {e.status for e in episodes} == {"completed"}
    assert set(placed.values()) <= {"rollout1", "rollout2"}
    # Each rollout ran on the machine that prepared its runtime, never on the other one.
    for episode_id, host in placed.items():
        other = "rollout2" if host == "rollout1" else "rollout1"
        assert f"episode={episode_id} event=rollout" in procs[f"{host}-rollout"].output()
        assert f"episode={episode_id} event=rollout" not in procs[f"{other}-rollout"].output()
    # The engine serves the last step's weights, and its machine never saw the trainer's files.
    assert httpx.get(f"http://{gw}:8200/v1/policy_version").json()["policy_version"] == 2
    assert (vars_["trainer"] / "runs" / str(run_id) / "checkpoints").is_dir()
    for name in ("gateway", "rollout1", "rollout2", "control"):
        assert not list((vars_[name] / "runs").glob("*/checkpoints/*")), name
    # No machine holds a TCP socket on 127.0.0.1, nor has the address at all.
    for host in hosts.values():
        assert _loopback_sockets(host) == [], host.name
        lo = subprocess.run(host.cmd(["ip", "-o", "addr", "show", "dev", "lo"]), capture_output=True, text=True).stdout
        assert "127.0.0.1" not in lo and "::1" not in lo, lo
