"""SWE-bench's own eval scripts and image names for published rows, from swebench 4.1.0's spec table.

Published SWE-bench / Verified / Lite rows carry no `eval_script`: swebench up to 4.1.0
built it from code, per repo and version (`harness/constants/python.py`
`MAP_REPO_VERSION_TO_SPECS`: test command, install line, eval commands), in
`harness/test_spec/test_spec.py::make_test_spec`.  swebench 5.0.2, which grades here,
moved that into data columns and dropped the table.  So the table's own code is installed
beside it (`requirements-swebench-specs.txt`, `pip install --no-deps --target
.venv/opt/swebench-4.1.0`) and run in a child Python, where the two releases never meet in
one `sys.modules`.  The child calls 4.1.0's `make_eval_script_list` (the eval part of
`make_test_spec`; its env part downloads requirement files from GitHub) and its `TestSpec`
for the image name, so the script is exactly what swebench's harness runs.

    specs = eval_specs([row, ...])   # {instance_id: {"eval_script", "image"} or {"error"}}
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

SPECS_VERSION = "4.1.0"
SPECS_DIR = Path(sys.prefix) / "opt" / f"swebench-{SPECS_VERSION}"

# Runs in the child: swebench 4.1.0 first on sys.path; its package `__init__`s (the
# collection scripts, docker, modal) never run and `datasets` / `dotenv`, imported by `harness/utils.py` but unused
# for scripts, are empty stand-ins.
_CHILD = r'''
import importlib, json, sys, types
sys.path.insert(0, sys.argv[1])
for name in ("datasets", "dotenv"):
    m = types.ModuleType(name)
    m.Dataset = m.load_dataset = m.load_from_disk = None
    m.load_dotenv = lambda *a, **k: False
    sys.modules.setdefault(name, m)
root = sys.argv[1] + "/swebench"
for name, path in (("swebench", root), ("swebench.harness", root + "/harness")):
    m = types.ModuleType(name); m.__path__ = [path]; sys.modules[name] = m
import importlib.metadata as md
found = [d.version for d in md.distributions(path=[sys.argv[1]]) if d.metadata["Name"] == "swebench"]
assert found == [sys.argv[2]], found
c = importlib.import_module("swebench.harness.constants")
cs = importlib.import_module("swebench.harness.test_spec.create_scripts")
ts = importlib.import_module("swebench.harness.test_spec.test_spec")
out = {}
for row in json.load(sys.stdin):
    iid, repo, version = row["instance_id"], row["repo"], row["version"]
    specs = c.MAP_REPO_VERSION_TO_SPECS.get(repo)
    if specs is None:
        out[iid] = {"error": f"repo {repo!r} is not in swebench {sys.argv[2]}'s spec table "
                             f"({len(c.MAP_REPO_VERSION_TO_SPECS)} repos)"}
        continue
    if version not in specs:
        out[iid] = {"error": f"version {version!r} of {repo} is not in swebench {sys.argv[2]}'s spec table "
                             f"(known: {', '.join(sorted(specs))})"}
        continue
    try:
        lines = cs.make_eval_script_list(row, specs[version], "testbed", "/testbed", row["base_commit"],
                                         row["test_patch"])
        spec = ts.TestSpec(instance_id=iid, repo=repo, version=version, repo_script_list=[], eval_script_list=lines,
                           env_script_list=[], arch="x86_64", FAIL_TO_PASS=[], PASS_TO_PASS=[],
                           language=c.MAP_REPO_TO_EXT[repo], docker_specs={}, namespace=row["namespace"])
        out[iid] = {"eval_script": spec.eval_script, "image": spec.instance_image_key}
    except Exception as exc:
        out[iid] = {"error": f"swebench {sys.argv[2]} could not build the eval script: {type(exc).__name__}: {exc}"}
json.dump(out, sys.stdout)
'''


class SpecsUnavailable(RuntimeError):
    """swebench's spec table is not installed here (the message says how to install it)."""


@functools.lru_cache(maxsize=1)
def _check_installed() -> None:
    if not (SPECS_DIR / "swebench" / "harness" / "constants" / "python.py").is_file():
        raise SpecsUnavailable(
            f"swebench {SPECS_VERSION}'s spec table is not installed at {SPECS_DIR}; run "
            f"`.venv/bin/pip install --no-deps --target {SPECS_DIR} -r requirements-swebench-specs.txt` "
            "(scripts/install.sh does)")


def eval_specs(rows: Sequence[dict[str, Any]], *, namespace: str = "swebench",
               timeout_s: float = 120) -> dict[str, dict[str, str]]:
    """{instance_id: {"eval_script": bash text, "image": "<namespace>/sweb.eval.x86_64.<id>:latest"}}, or
    {instance_id: {"error": why}} for a row whose repo or version swebench's table does not know.

    `rows`: dicts with instance_id, repo, version, base_commit, test_patch (strings).
    `namespace`: the registry namespace of the images (swebench's `__` → `_1776_` rename applies).
    Raises `SpecsUnavailable` when the table is not installed, RuntimeError when the child fails.
    """
    if not rows:
        return {}
    _check_installed()
    keys = ("instance_id", "repo", "version", "base_commit", "test_patch")
    payload = [{k: str(r.get(k) or "") for k in keys} | {"namespace": namespace} for r in rows]
    proc = subprocess.run([sys.executable, "-I", "-c", _CHILD, str(SPECS_DIR), SPECS_VERSION],
                          input=json.dumps(payload), capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"swebench {SPECS_VERSION} spec child failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)
