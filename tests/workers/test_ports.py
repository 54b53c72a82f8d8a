"""`python -m workers.ports` (what `make up` runs first) and `python -m workers.wait` (scripts/with_stack.sh), as subprocesses."""
from __future__ import annotations

import subprocess
import sys

from support import ROOT


def test_make_up_refuses_to_start_twice_with_one_line(monkeypatch):
    """`make up` checks the configured ports first: a second stack gets one line naming them."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        env = {"PATH": "/usr/bin:/bin", "TURNSTILE_API_BIND": f"127.0.0.1:{port}", "TURNSTILE_VAR_DIR": "/tmp"}
        busy = subprocess.run([sys.executable, "-m", "workers.ports"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=60)
    assert busy.returncode == 1
    assert busy.stderr.count("\n") == 1 and f"api :{port}" in busy.stderr and "already running" in busy.stderr
    free = subprocess.run([sys.executable, "-m", "workers.ports"], cwd=ROOT, timeout=60, capture_output=True, text=True,
                          env={**env, "TURNSTILE_ENGINE_PORT": "1", "TURNSTILE_FLOWER_PORT": "2",
                               "TURNSTILE_TENSORBOARD_PORT": "3", "TURNSTILE_GATEWAY_BIND": "127.0.0.1:4"})
    assert free.returncode == 0, free.stderr


def test_wait_names_what_did_not_come_up_in_time():
    """Port 1 on localhost refuses connections: `wait` gives up after --timeout and names the target."""
    proc = subprocess.run([sys.executable, "-m", "workers.wait", "--timeout", "1", "nothing=http://127.0.0.1:1/health"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "not up after 1 s: nothing" in proc.stderr
