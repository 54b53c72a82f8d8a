"""The stream reader in a gevent gateway worker (gevent is the gateway's default worker class):
`tests/engines/test_stream.py` run again in a process whose `select`, sockets and threads gevent has
monkey-patched, so every wait goes through `app.engines.socket_wait.HubWait` and `close` from another
greenlet must wake a waiting `poll`.  `test_poll_zero_looks_without_waiting` is left out there: its
loop of non-blocking looks never yields to the greenlet serving it, so under gevent that server
never sends (no gateway code loops on `poll(0)`)."""
from __future__ import annotations

import subprocess
import sys

from app.config import ROOT

_RUN = """
from gevent import monkey
monkey.patch_all()
import sys
import pytest
from app.engines.socket_wait import gevent_select
assert gevent_select(), "select is not gevent's: the waits would not take the gevent path"
sys.exit(pytest.main(["tests/engines/test_stream.py", "-q", "-n", "0", "-p", "no:cacheprovider",
                      "-k", "not test_poll_zero_looks_without_waiting"]))
"""


def test_the_stream_reader_passes_its_tests_under_gevent():
    proc = subprocess.run([sys.executable, "-c", _RUN], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
