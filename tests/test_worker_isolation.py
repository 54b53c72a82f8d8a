"""The suite's own isolation (tests/worker_isolation.py): a plain `pytest` run, outside xdist,
must not write into the checkout's var folder, where a developer's real runs live."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from app.config import ROOT


def test_a_plain_pytest_process_gets_a_private_var_folder_and_keeps_the_default_redis():
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_XDIST_WORKER", "TURNSTILE_VAR_DIR", "TURNSTILE_TEST_REDIS", "REDIS_URL")}
    code = ("import os, worker_isolation as w; var = w.isolate_test_process(); "
            "print(os.environ['TURNSTILE_VAR_DIR']); print(os.path.realpath(var / 'models')); "
            "print(os.environ.get('REDIS_URL', '-'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests", env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    var, models, redis_url = Path(out[0]), out[1], out[2]
    assert var != ROOT / "var" and ROOT not in var.parents
    assert models == os.path.realpath(ROOT / "var" / "models")  # the model cache is shared, not copied
    assert redis_url == "-"  # no private Redis outside xdist: conftest then uses the default server's DB 10
    assert not var.exists()  # removed when the process exits
