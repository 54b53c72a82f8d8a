"""A cached virtualenv per instance environment (python + install commands + source tree).

Built once per `env_key` under `<cache>/envs/<key>/`, file-locked, then reused by
every runtime of every instance that shares it (e.g. the four inflection
instances share one venv).

Confined layout (bubblewrap present): the venv is built *inside* a build sandbox
with the repository at `/testbed` and the venv at `/venv`, the same paths every
episode sandbox uses.  Editable installs (`pip install --no-deps -e .`) record
`/testbed`, so at episode time the venv is bind-mounted read-only at `/venv` and
imports resolve to that episode's own workspace.  The agent cannot change the
shared venv (read-only mount); files the install left in the tree (e.g.
`*.egg-info/`, ignored by git) are kept as an `overlay/` copied into each fresh
workspace, so the tree looks exactly as it did after the install.

Plain layout (no bubblewrap): the venv is built at its real path; each runtime
gets its own `cp -a` copy and re-runs the install commands in its workspace
(pins are already satisfied, so only the editable install does work), so the
editable install points at that runtime's workspace.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from app.config import get_settings
from app.runtimes.errors import RuntimeSetupError
from app.gitutil import git
from app.runtimes.paths import RuntimePaths, build_lock
from app.runtimes.sandbox import Limits, Mount, bwrap_argv, execute
from app.tasksets.schema import InstanceRecord

SANDBOX_REPO = "/testbed"
SANDBOX_VENV = "/venv"
BUILD_TIMEOUT_S = 1200
_PACKAGING_FILES = {"setup.py", "setup.cfg", "pyproject.toml", "MANIFEST.in"}
# Variables a venv build passes through from the worker (registry, proxy and CA settings).
_PASS_ENV = re.compile(r"^(PIP_.*|SSL_CERT_.*|REQUESTS_CA_BUNDLE|CURL_CA_BUNDLE|(?i:https?_proxy|no_proxy|all_proxy))$")


@dataclass(frozen=True)
class PythonInterpreter:
    """A host interpreter: `version` ("3.11.7"), `executable` (real path), `prefix` (its sys.base_prefix)."""

    version: str
    executable: Path
    prefix: Path


@functools.lru_cache(maxsize=None)
def find_python(version: str) -> PythonInterpreter:
    """Interpreter for `version` ("3.11"): pyenv versions first, then `pythonX.Y` on PATH.

    Raises `RuntimeSetupError("python")` when none is installed.
    """
    roots = [str(get_settings().pyenv_root or ""), str(Path.home() / ".pyenv")]
    candidates = []
    for root in filter(None, roots):
        candidates += sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"), reverse=True)
        candidates += glob.glob(f"{root}/versions/{version}/bin/python{version}")
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if "shims" not in d:
            candidates.append(os.path.join(d, f"python{version}"))
    for cand in candidates:
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            proc = subprocess.run([cand, "-I", "-c", "import sys,platform;print(platform.python_version());print(sys.base_prefix)"],
                                  capture_output=True, text=True)
            if proc.returncode == 0:
                ver, prefix = proc.stdout.split()
                return PythonInterpreter(ver, Path(cand).resolve(), Path(prefix).resolve())
    raise RuntimeSetupError("python", f"no Python {version} interpreter found (pyenv versions or python{version} on PATH)")


@dataclass(frozen=True)
class Environment:
    """A built env: `venv` (host path), `overlay` (files to copy into each workspace), layout `confined`."""

    key: str
    root: Path
    python: PythonInterpreter
    confined: bool
    install: tuple[str, ...]

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def overlay(self) -> Path:
        return self.root / "overlay"


def env_key(record: InstanceRecord, python: PythonInterpreter, confined: bool) -> str:
    """16 hex digits over python version, install commands, source identity and layout."""
    if record.source_kind == "pypi_sdist":
        src = record.source.sha256
    elif record.source_kind == "inline":
        src = hashlib.sha256(json.dumps(record.source.files, sort_keys=True).encode()).hexdigest()
    else:
        src = f"{record.repo}@{record.base_commit}"
    touched = set(re.findall(r"^diff --git a/(\S+)", record.bug_patch, flags=re.M))
    packaging = record.bug_patch if {Path(t).name for t in touched} & _PACKAGING_FILES else ""
    blob = json.dumps({"python": python.version, "install": record.install, "source": src,
                       "packaging_patch": packaging, "layout": "bwrap-v1" if confined else "plain-v1"}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_env_vars(home: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if _PASS_ENV.match(k)}
    settings = get_settings()  # pip settings given in .env reach the build's pip too
    for name, value in (("PIP_INDEX_URL", settings.pip_index_url), ("PIP_CACHE_DIR", settings.pip_cache_dir)):
        if value:
            env.setdefault(name, str(value))
    env.update(HOME=home, LANG="C.UTF-8", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def _install_script(venv: str, python: PythonInterpreter, commands: tuple[str, ...], create: bool) -> str:
    lines = ["set -euo pipefail"]
    if create:
        lines.append(f"{python.executable} -m venv {venv}")
    lines += [f"export VIRTUAL_ENV={venv} PATH={venv}/bin:$PATH", *commands]
    return "\n".join(lines) + "\n"


def _pip_cache() -> Path:
    return get_settings().pip_cache_dir or Path.home() / ".cache" / "pip"


def run_install(
    *, repo: Path, venv: Path, python: PythonInterpreter, commands: tuple[str, ...], confined: bool,
    create: bool, home: Path,
) -> None:
    """Create (optionally) the venv and run `commands` in `repo`; raises `RuntimeSetupError("install")`."""
    if confined:
        pip_cache = _pip_cache()
        pip_cache.mkdir(parents=True, exist_ok=True)
        mounts = [Mount(repo, SANDBOX_REPO, True), Mount(venv, SANDBOX_VENV, True),
                  Mount(home, "/home/build", True), Mount(pip_cache, str(pip_cache), True)]
        for extra in (Path("/opt"), Path.home() / ".config" / "pip"):
            if extra.is_dir():  # local wheel mirrors / pip config the worker uses
                mounts.append(Mount(extra, str(extra), False))
        env = build_env_vars("/home/build")
        env.update(PATH="/usr/local/bin:/usr/bin:/bin", PIP_CACHE_DIR=str(pip_cache))
        if (Path.home() / ".config" / "pip" / "pip.conf").is_file():
            env["PIP_CONFIG_FILE"] = str(Path.home() / ".config" / "pip" / "pip.conf")
        argv = bwrap_argv(["/bin/bash", "-c", _install_script(SANDBOX_VENV, python, commands, create)],
                          mounts=mounts, workdir=SANDBOX_REPO, env=env, network="host",
                          python_prefixes=[python.prefix])
        res = execute(argv, timeout_s=BUILD_TIMEOUT_S, limits=Limits(memory_mb=8192), confined=True, network="host")
    else:
        env = build_env_vars(str(home))
        env["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
        res = execute(["/bin/bash", "-c", _install_script(str(venv), python, commands, create)],
                      timeout_s=BUILD_TIMEOUT_S, limits=Limits(memory_mb=8192), confined=False, env=env, cwd=repo)
    if not res.ok:
        raise RuntimeSetupError("install", f"exit {res.exit_code}{' (timeout)' if res.timed_out else ''}: {(res.stdout + res.stderr)[-3000:]}")


def ensure_env(record: InstanceRecord, base: Path, paths: RuntimePaths, *, confined: bool) -> Environment:
    """The cached environment for `record` (building it from a copy of `base` once)."""
    python = find_python(record.python)
    key = env_key(record, python, confined)
    env = Environment(key, paths.envs / key, python, confined, tuple(record.install))
    done = env.root / "READY"
    if done.exists():
        return env
    with build_lock(paths.envs / f".{key}.lock"):
        if done.exists():
            return env
        shutil.rmtree(env.root, ignore_errors=True)
        env.root.mkdir(parents=True)
        try:
            testbed, home = env.root / "testbed", env.root / "home"
            subprocess.run(["cp", "-a", str(base), str(testbed)], check=True)
            env.venv.mkdir()
            home.mkdir()
            run_install(repo=testbed, venv=env.venv, python=python, commands=env.install,
                        confined=confined, create=True, home=home)
            if confined:
                _save_overlay(testbed, env.overlay)
                shutil.rmtree(testbed)  # the venv refers to /testbed, i.e. each runtime's workspace
            shutil.rmtree(home, ignore_errors=True)
            done.write_text(json.dumps({"python": python.version, "install": list(env.install)}))
        except BaseException:
            shutil.rmtree(env.root, ignore_errors=True)
            raise
    return env


def _save_overlay(testbed: Path, overlay: Path) -> None:
    """Copy what the install left in the tree (untracked or ignored, no bytecode) to `overlay`."""
    out = git(testbed, "status", "--porcelain", "--ignored", "--untracked-files=all", stage="overlay").stdout
    overlay.mkdir()
    for line in out.splitlines():
        rel = line[3:].rstrip("/")
        if "__pycache__" in rel or rel.endswith((".pyc", ".pyo")):
            continue
        src, dst = testbed / rel, overlay / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir() and not src.is_symlink():
            shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.exists() or src.is_symlink():
            shutil.copy2(src, dst, follow_symlinks=False)


def apply_overlay(env: Environment, workspace: Path) -> None:
    """Copy the env's overlay files into a fresh workspace (no-op when empty)."""
    if env.overlay.is_dir() and any(env.overlay.iterdir()):
        subprocess.run(["cp", "-a", f"{env.overlay}/.", str(workspace)], check=True)


def plain_runtime_venv(env: Environment, workspace: Path, dest: Path, home: Path) -> Path:
    """Plain layout only: a private copy of the venv at `dest`, with the installs re-run in `workspace`."""
    subprocess.run(["cp", "-a", str(env.venv), str(dest)], check=True)
    run_install(repo=workspace, venv=dest, python=env.python, commands=env.install, confined=False,
                create=False, home=home)
    return dest

