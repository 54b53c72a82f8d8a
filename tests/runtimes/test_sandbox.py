"""Sandbox escape attempts: an agent command in a LocalRuntime under bubblewrap.

The agent tries to read the database, another episode's workspace, the caches
(pristine sdists), the task records (gold patch), a grading runtime's files, to
reach PostgreSQL / Redis / PyPI, to write outside its workspace, and to outlive
its timeout.  Every attempt must fail, while the gateway stays reachable.
Real bubblewrap, real PostgreSQL and Redis ports, a real TCP gateway stand-in.
"""
from __future__ import annotations

import http.server
import os
import socketserver
import threading
from pathlib import Path

import pytest

from app import config
from app.config import ROOT, get_settings
from app.runtimes import LocalRuntime, RuntimePaths, bwrap_available
from app.tasksets import load_task_set
from support import wait_for

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap (Debian package `bubblewrap`) is not installed/usable here")



@pytest.fixture
def gateway():
    """A real HTTP server on the host's loopback standing in for the gateway."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = f"gateway saw {self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def two_runtimes(settings, gateway):
    ts = load_task_set("synthetic")
    a = LocalRuntime.prepare(ts.get("synthetic__inflection-1"), settings=settings, gateway_url=gateway)
    b = LocalRuntime.prepare(ts.get("synthetic__inflection-2"), settings=settings, gateway_url=gateway)
    yield ts, a, b
    a.close()
    b.close()


def _fails(rt, cmd, network="none"):
    res = rt.run(cmd, network=network, timeout_s=60)
    assert res.confined
    return res.exit_code != 0, res


def test_agent_cannot_read_outside_its_workspace(two_runtimes, settings):
    ts, a, b = two_runtimes
    paths = RuntimePaths.from_settings(settings)
    db = settings.var_dir / "turnstile.db"
    db.write_text("SECRET-DATABASE")
    (b.root / "grading").mkdir()
    (b.root / "grading" / "eval.sh").write_text("SECRET test_patch of another grade")
    sdist = next(paths.sdists.glob(f"{ts.get('synthetic__inflection-1').source.sha256}/*"))

    for target in [db, b.workspace / "inflection" / "__init__.py", b.root / "grading" / "eval.sh", sdist,
                   ROOT / "data" / "tasks" / "synthetic.jsonl", ROOT / "app" / "config.py",
                   "/root/.cache/pip", paths.bases, "/etc/shadow", "/etc/ssh", "/etc/redis", "/etc/postgresql"]:
        failed, res = _fails(a, f"cat {target} || ls {target}")
        assert failed, f"agent could read {target}: {res.stdout[:200]}"
        assert "SECRET" not in res.stdout
    # Its own workspace is there, read-write; the grading mount is not.
    res = a.run("test -f /testbed/inflection/__init__.py && test ! -e /run/turnstile/grading && echo ok")
    assert res.stdout.strip() == "ok"


def test_gold_patch_is_nowhere_in_the_agent_view(two_runtimes):
    ts, a, _ = two_runtimes
    rec = ts.get("synthetic__inflection-1")
    fixed_line = "if number % 100 in (11, 12, 13):"
    assert fixed_line in rec.patch
    res = a.run("git log --all --oneline | wc -l; git log --all -p | grep -c -F 'in (11, 12, 13)'; "
                "grep -r -F -l 'in (11, 12, 13)' /testbed /home/agent /tmp /venv 2>/dev/null | wc -l")
    commits, in_history, in_files = res.stdout.split()
    assert (commits, in_history, in_files) == ("1", "0", "0")


def test_gateway_is_reachable_from_a_runtime_folder_too_deep_for_a_unix_socket(tmp_path, monkeypatch, gateway):
    """A Unix socket address holds at most 107 bytes of path (Linux sun_path); a deep var folder
    (here ~200 bytes) must not break the sandbox's way to the gateway."""
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "var"
    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(deep))
    monkeypatch.setenv("TURNSTILE_CACHE_DIR", str(ROOT / "var" / "cache"))
    config.reset_settings()
    rt = LocalRuntime.prepare(load_task_set("synthetic").get("synthetic__inflection-1"), settings=get_settings(),
                              gateway_url=gateway)
    try:
        assert len(os.fsencode(str(rt.root / "gateway.sock"))) > 107
        fetch = "python -c \"import os,urllib.request;print(urllib.request.urlopen(os.environ['GW']+'/models').read().decode())\""
        res = rt.run(fetch, env={"GW": rt.gateway_url}, network="gateway", timeout_s=60)
        assert res.exit_code == 0 and res.stdout.strip() == "gateway saw /v1/models", res.stderr
    finally:
        rt.close()
        config.reset_settings()


def test_network_is_only_the_gateway(two_runtimes):
    _, a, _ = two_runtimes
    probe = (
        "python - <<'EOF'\n"
        "import socket\n"
        "for host, port in [('127.0.0.1', 5432), ('127.0.0.1', 6379), ('pypi.org', 443), ('151.101.0.223', 443)]:\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=5).close(); print(host, port, 'OPEN')\n"
        "    except OSError as exc:\n"
        "        print(host, port, 'blocked', type(exc).__name__)\n"
        "EOF"
    )
    for network in ("none", "gateway"):
        res = a.run(probe, network=network, timeout_s=60)
        assert res.exit_code == 0, res.stderr
        assert "OPEN" not in res.stdout and res.stdout.count("blocked") == 4, res.stdout
    res = a.run("python -m pip download --retries 0 --timeout 3 --no-deps -d /tmp/x inflection==0.5.1", timeout_s=120)
    assert res.exit_code != 0
    # The host really has these services: the probe is not vacuous.
    import socket

    socket.create_connection(("127.0.0.1", 6379), timeout=5).close()

    assert a.gateway_url.startswith("http://127.0.0.1:")
    fetch = "python -c \"import os,urllib.request;print(urllib.request.urlopen(os.environ['GW']+'/models').read().decode())\""
    res = a.run(fetch, env={"GW": a.gateway_url}, network="gateway", timeout_s=60)
    assert res.exit_code == 0 and res.stdout.strip() == "gateway saw /v1/models", res.stderr
    res = a.run(fetch, env={"GW": a.gateway_url}, network="none", timeout_s=60)
    assert res.exit_code != 0


def test_writes_only_in_workspace_home_and_tmp(two_runtimes):
    _, a, _ = two_runtimes
    for target in ["/usr/pwned", "/etc/pwned", "/venv/pwned", "/venv/lib/python3.11/site-packages/pwned.pth"]:
        failed, _ = _fails(a, f"touch {target}")
        assert failed, target
    # With capabilities, a root sandbox could remount a read-only bind read-write.
    res = a.run("mount -o remount,rw,bind /venv; touch /venv/pwned; "
                "mount -o remount,rw,bind /usr; touch /usr/pwned; grep CapEff /proc/self/status")
    assert res.stdout.split()[-1] == "0000000000000000"
    assert not (Path(a.describe()["venv"]) / "pwned").exists() and not Path("/usr/pwned").exists()
    res = a.run("touch /testbed/new_file $HOME/x /tmp/y && echo ok")
    assert res.stdout.strip() == "ok"
    assert (a.workspace / "new_file").exists() and (a.home / "x").exists()


def test_own_pid_namespace_and_timeout_kills_everything(two_runtimes):
    _, a, _ = two_runtimes
    res = a.run(f"kill -0 {os.getpid()} 2>/dev/null && echo visible || echo hidden; ps -e --no-headers | wc -l")
    word, count = res.stdout.split()
    assert word == "hidden" and int(count) < 10
    # The command sleeps for an hour: its run returning at all, as timed out, is the timeout's kill.
    res = a.run("(setsid sleep 4242.5 &); sleep 4242.5", timeout_s=1.5)
    assert res.timed_out and res.exit_code == 124
    # A killed process leaves /proc once reaped; the wait only bounds a hang, none may stay.
    wait_for(lambda: not _alive(b"4242.5"), 30, interval=0.1, what=lambda: f"no sleep left: {_alive(b'4242.5')}")


def test_no_process_in_the_sandbox_shows_the_workers_environment(two_runtimes, monkeypatch):
    """Every /proc/<pid>/environ inside (bwrap's own PID 1 included) is free of the worker's secrets."""
    _, a, _ = two_runtimes
    monkeypatch.setenv("TURNSTILE_SECRET_PROBE", "hunter2")
    res = a.run("for p in /proc/[0-9]*; do tr '\\0' '\\n' < $p/environ 2>/dev/null; done; echo END")
    assert res.ok and res.stdout.rstrip().endswith("END")
    assert "hunter2" not in res.stdout and "DATABASE_URL" not in res.stdout and "REDIS_URL" not in res.stdout


def test_a_symlinked_tools_folder_works_by_both_paths(settings, tmp_path):
    """A tools folder that is a symbolic link to another place: scripts inside name their
    interpreter by the resolved path (as a venv does), and both paths work in the sandbox."""
    real = tmp_path / "disk2" / "tools"
    (real / "bin").mkdir(parents=True)
    tool = real / "bin" / "tool"
    tool.write_text(f"#!/bin/sh\nexec {real}/bin/helper \"$@\"\n")
    helper = real / "bin" / "helper"
    helper.write_text("#!/bin/sh\necho helper-ran\n")
    tool.chmod(0o755)
    helper.chmod(0o755)
    link = tmp_path / "tools"
    link.symlink_to(real)
    record = load_task_set("synthetic").get("synthetic__inflection-2")
    with LocalRuntime.prepare(record, settings=settings, ro_binds=[(link, str(link))]) as rt:
        res = rt.run(f"{link}/bin/tool && {real}/bin/tool")
        assert res.ok, res.stderr
        assert res.stdout.split() == ["helper-ran", "helper-ran"]


def test_should_stop_kills_the_command_at_once(two_runtimes):
    """A cancelled episode's harness is killed within a poll, not at the end of its budget."""
    _, a, _ = two_runtimes
    asks = []

    def should_stop() -> bool:  # says stop at its third poll: the command ran, then is cancelled
        asks.append(1)
        return len(asks) >= 3

    res = a.run("(setsid sleep 4343.5 &); sleep 4343.5", timeout_s=120, should_stop=should_stop)
    # Stopped (130), not at the budget (timed out): killed at the poll that asked, none later.
    assert res.stopped and not res.timed_out and res.exit_code == 130 and not res.ok
    assert len(asks) == 3
    wait_for(lambda: not _alive(b"4343.5"), 30, interval=0.1, what=lambda: f"no sleep left: {_alive(b'4343.5')}")


def _alive(needle: bytes) -> list[str]:
    """Pids of this host whose command line holds `needle`."""
    return [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_has(pid, needle)]


def _cmdline_has(pid: str, needle: bytes) -> bool:
    try:
        return needle in open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return False


def test_close_removes_everything_and_is_idempotent(settings):
    rec = load_task_set("synthetic").get("synthetic__toolz-1")
    with LocalRuntime.prepare(rec, settings=settings) as rt:
        state = rt.describe()
        root = rt.root
        again = LocalRuntime.attach(state)
        assert again.run("ls toolz/__init__.py").exit_code == 0
    assert not root.exists()
    again.close()
    rt.close()


def test_memory_and_cpu_limits(settings):
    from app.runtimes import Limits

    rec = load_task_set("synthetic").get("synthetic__inflection-5")
    with LocalRuntime.prepare(rec, settings=settings, limits=Limits(memory_mb=256, cpu_s=2)) as rt:
        res = rt.run("python -c 'x = bytearray(1024 ** 3); print(len(x))'")
        assert res.exit_code != 0 and "MemoryError" in res.stderr
        res = rt.run("python -c 'while True: pass'", timeout_s=60)
        # RLIMIT_CPU: SIGXCPU (24) at the soft limit, well before the wall-clock timeout.
        assert not res.timed_out and res.exit_code == 128 + 24


def test_stale_runtimes_are_swept_but_kept_ones_stay(settings):
    from app.runtimes import cleanup_stale_runtimes

    rec = load_task_set("synthetic").get("synthetic__inflection-5")
    live = LocalRuntime.prepare(rec, settings=settings)
    orphan = LocalRuntime.prepare(rec, settings=settings)  # as if its worker died before close()
    try:
        assert cleanup_stale_runtimes(3600, settings=settings) == []  # too young
        removed = cleanup_stale_runtimes(0, keep=[live.id], settings=settings)
        assert removed == [orphan.id] and not orphan.root.exists() and live.root.exists()
    finally:
        live.close()


FORK_LOOP = ("python -c \"import os, time\nn = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n"
             "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(2)\n        os._exit(0)\n"
             "    n += 1\nprint(n)\"")


def test_a_fork_bomb_stops_at_the_process_cap_and_is_reported(settings):
    """200 forks under a 40-process cap: fewer than 40 start (the worker runs as root here, where
    RLIMIT_NPROC does not apply: the cap is the command's pids cgroup), and the cap hit is named."""
    from app.runtimes import Limits, cgroups

    rec = load_task_set("synthetic").get("synthetic__inflection-5")
    with LocalRuntime.prepare(rec, settings=settings, limits=Limits(nproc=40)) as rt:
        res = rt.run(FORK_LOOP, timeout_s=60)
    started = int(res.stdout.split()[-1])
    assert started < 40, res
    if "pids" in cgroups.available():
        assert res.limit_hit and "process limit reached: 40 processes" in res.limit_hit


def test_memory_cap_covers_all_processes_of_a_command(settings):
    """Three processes of 120 MiB each stay under a 256 MiB per-process RLIMIT_DATA but not under
    the command's 256 MiB memory cgroup: some are OOM-killed and the hit is named."""
    from app.runtimes import Limits, cgroups

    if "memory" not in cgroups.available():
        pytest.fail(f"no writable memory cgroup here ({cgroups.available()}): the memory cap is per process only")
    rec = load_task_set("synthetic").get("synthetic__inflection-5")
    hog = "python -c \"x = b'a' * (120 << 20); import time; time.sleep(1)\""
    with LocalRuntime.prepare(rec, settings=settings, limits=Limits(memory_mb=256)) as rt:
        res = rt.run(f"for i in 1 2 3; do {hog} & done; wait", timeout_s=60)
    assert res.limit_hit and "memory limit reached: 256 MiB" in res.limit_hit and "Killed" in res.stderr


def test_writes_past_the_tmpfs_and_disk_caps_fail(settings):
    """Each tmpfs (/, /tmp, /dev/shm) stops at its size with ENOSPC and /dev is read-only; filling
    the workspace past the disk cap gets the command killed with the cap named."""
    from app.runtimes import Limits

    rec = load_task_set("synthetic").get("synthetic__inflection-5")
    with LocalRuntime.prepare(rec, settings=settings, limits=Limits(tmpfs_mb=8, disk_mb=48)) as rt:
        res = rt.run("for f in /tmp/big /dev/shm/big /big; do head -c 20M /dev/zero > $f; "
                     "echo $f $(stat -c %s $f); done; echo x > /dev/x || echo dev-ro", timeout_s=60)
        assert res.stderr.count("No space left on device") == 3, res.stderr
        sizes = dict(line.split() for line in res.stdout.splitlines() if line.startswith("/"))
        assert sizes == {"/tmp/big": str(8 << 20), "/dev/shm/big": str(8 << 20), "/big": str(8 << 20)}
        assert res.stdout.strip().endswith("dev-ro")
        res = rt.run("for i in $(seq 20); do head -c 8M /dev/zero > /testbed/f$i; sleep 0.2; done; echo done",
                     timeout_s=60)
        assert res.exit_code == 137 and "done" not in res.stdout
        assert res.limit_hit and "disk limit reached" in res.limit_hit and "limit 48 MiB" in res.limit_hit


def test_a_cap_hit_is_the_episodes_failure_reason_not_a_harness_failure(tmp_path):
    from app.control.real_stages import SANDBOX_LIMIT, sandbox_limit_failure
    from app.control.stages import harness_failure_cause

    error = sandbox_limit_failure("process limit reached: 40 processes", "log " * 2000, tmp_path / "h.log")
    assert error.startswith(SANDBOX_LIMIT + "process limit reached: 40 processes\n")
    assert harness_failure_cause(error) is None  # not counted as "the harness never worked"
    assert len(error) < 4000
