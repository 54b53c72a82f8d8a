"""Materialization: sdist hash check, git sources from a local mirror, patch extraction, unconfined fallback."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from app.config import ROOT
from app.grading import grade
from app.runtimes import LocalRuntime, RuntimePaths, RuntimeSetupError, bwrap_available, materialize_base
from app.runtimes import sdist as sdist_mod
from app.tasksets import InstanceRecord, load_task_set

needs_bwrap = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap (Debian package `bubblewrap`) is not installed/usable here")



def test_sdist_base_is_one_commit_with_the_recorded_id(settings):
    rec = load_task_set("synthetic").get("synthetic__boltons-2")
    base = materialize_base(rec, RuntimePaths.from_settings(settings))
    log = subprocess.run(["git", "-C", str(base), "log", "--format=%H %an <%ae> %aI %s"], capture_output=True, text=True).stdout
    assert log.strip() == f"{rec.sdist_base_commit} sdist <sdist@localhost> 2020-01-01T00:00:00+00:00 boltons 26.2.0"
    exclude = (base / ".git" / "info" / "exclude").read_text()
    assert "*.egg-info/" in exclude and "__pycache__/" in exclude
    # The injected bug is in the tree (the gold patch applies forward).
    assert subprocess.run(["git", "-C", str(base), "apply", "--check", "-"], input=rec.patch, text=True).returncode == 0


def test_tampered_sdist_is_refused(tmp_path, monkeypatch):
    """A download whose bytes differ from `source.sha256` (e.g. a compromised mirror) is refused.

    The index lookup is replaced by one returning other bytes: a tampered archive cannot be
    produced from the real PyPI, which serves by hash.
    """
    rec = load_task_set("synthetic").get("synthetic__inflection-1")

    def tampered(source, dest_dir: Path) -> Path:
        p = dest_dir / source.filename
        p.write_bytes(b"not the archive")
        return p

    monkeypatch.setattr(sdist_mod, "_download_simple", tampered)
    paths = RuntimePaths(var_dir=tmp_path, cache_dir=tmp_path / "cache")
    with pytest.raises(RuntimeSetupError) as info:
        materialize_base(rec, paths)
    assert info.value.stage == "sha256" and rec.source.sha256 in str(info.value)
    assert not list((tmp_path / "cache" / "sdists").glob("*/*"))  # nothing cached


def _git(repo: Path, *args: str, env: dict | None = None) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


@pytest.fixture
def git_upstream(tmp_path):
    """A local upstream repository with a buggy commit (base) and a later fix commit."""
    work = tmp_path / "upstream"
    work.mkdir()
    env = {"GIT_AUTHOR_NAME": "u", "GIT_AUTHOR_EMAIL": "u@x", "GIT_COMMITTER_NAME": "u", "GIT_COMMITTER_EMAIL": "u@x",
           "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    _git(work, "init", "-q", "-b", "main", env=env)
    (work / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (work / "test_calc.py").write_text("from calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n\n"
                                        "def test_zero():\n    assert add(0, 0) == 0\n")
    _git(work, "add", "-A", env=env)
    _git(work, "commit", "-q", "-m", "base", env=env)
    base = _git(work, "rev-parse", "HEAD")
    (work / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    _git(work, "commit", "-q", "-am", "fix", env=env)
    fix = _git(work, "rev-parse", "HEAD")
    gold = _git(work, "diff", base, fix) + "\n"
    bare = tmp_path / "upstream.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(bare)], check=True)
    return bare, base, fix, gold


@needs_bwrap
def test_git_source_from_local_mirror_grades(settings, git_upstream):
    bare, base, fix, gold = git_upstream
    rec = InstanceRecord.model_validate({
        "instance_id": "local__calc-1", "repo": "local/calc", "base_commit": base, "patch": gold,
        "problem_statement": "add() subtracts", "FAIL_TO_PASS": json.dumps(["test_calc.py::test_add"]),
        "PASS_TO_PASS": json.dumps(["test_calc.py::test_zero"]), "source": {"kind": "git", "url": str(bare)},
        "install": ["python -m pip install -q pytest==8.3.4"], "test_files": ["test_calc.py"],
        "test_cmd": "python -m pytest -rA -p no:cacheprovider --color=no test_calc.py",
    })
    paths = RuntimePaths.from_settings(settings)
    repo = materialize_base(rec, paths)
    assert _git(repo, "rev-parse", "HEAD") == base
    assert subprocess.run(["git", "-C", str(repo), "cat-file", "-e", fix]).returncode != 0  # the fix is not even present
    assert _git(repo, "remote") == "" and _git(repo, "for-each-ref", "--format=%(refname)") == "refs/heads/main"
    assert any(paths.mirrors.glob("*.git"))

    none = grade(rec, "", settings=settings, use_cache=False)
    gold_result = grade(rec, gold, settings=settings, use_cache=False)
    assert (none.resolved, gold_result.resolved) == (False, True)
    assert none.report["tests_status"]["FAIL_TO_PASS"]["failure"] == ["test_calc.py::test_add"]


@needs_bwrap
def test_patch_from_workspace_new_files_no_byproducts_and_hardened_git(settings, tmp_path):
    rec = load_task_set("synthetic").get("synthetic__inflection-1")
    marker = tmp_path / "host-side-effect"
    with LocalRuntime.prepare(rec, settings=settings) as rt:
        assert rt.patch() == ""
        script = (
            "set -e\n"
            "sed -i 's/in (11, 12):/in (11, 12, 13):/' inflection/__init__.py\n"
            "printf 'NOTE = 1\\n' > inflection/notes.py\n"
            "python -m pytest -q -x test_inflection.py >/dev/null || true\n"   # __pycache__
            "mkdir -p build dist foo.egg-info && touch build/x dist/y foo.egg-info/PKG-INFO .coverage\n"
            "git add -A && git commit -qm 'agent commit'\n"
            # A hostile repository config, set last (`git config` runs no hook): each
            # of these would run a command in any host-side git that trusted it.
            f"git config core.fsmonitor 'touch {marker}'\n"
            f"git config diff.external 'touch {marker}'\n"
            "printf '*.py diff=evil filter=evil\\n' > .gitattributes\n"
            f"git config diff.evil.textconv 'touch {marker}'\n"
            f"git config filter.evil.clean 'touch {marker}'\n"
            f"git config core.hooksPath /testbed/hooks\n"
        )
        res = rt.run(script, timeout_s=120)
        assert res.exit_code == 0, res.stderr
        patch = rt.patch()
        assert not marker.exists()
        # The threat is real: a naive host-side git in that workspace runs the agent's command.
        subprocess.run(["git", "diff", "HEAD~1"], cwd=rt.workspace, capture_output=True)
        assert marker.exists()
    files = sorted(line.split(" b/")[-1] for line in patch.splitlines() if line.startswith("diff --git"))
    assert files == [".gitattributes", "inflection/__init__.py", "inflection/notes.py"]
    assert "+    if number % 100 in (11, 12, 13):" in patch and "new file mode 100644" in patch
    # The extracted patch is exactly what fixes the instance.
    result = grade(rec, patch, settings=settings, use_cache=False)
    assert result.resolved and result.reward == 1.0


def test_unconfined_fallback_runs_and_says_so(settings):
    rec = load_task_set("synthetic").get("synthetic__inflection-4")
    with LocalRuntime.prepare(rec, settings=settings, confine=False) as rt:
        assert rt.confined is False and rt.describe()["confined"] is False
        res = rt.run("python -c 'import inflection; print(inflection.__file__)'")
        assert res.confined is False and res.exit_code == 0
        # The private venv's editable install points at this runtime's own workspace.
        assert res.stdout.strip() == str(rt.workspace / "inflection" / "__init__.py")
        # Unconfined means unconfined: the host is readable (why bubblewrap is the default).
        assert rt.run(f"test -r {ROOT / 'app' / 'config.py'}").exit_code == 0
        res = rt.run(rec.test_cmd, timeout_s=120)
        assert res.exit_code == 1 and "failed" in res.stdout  # the injected bug is there
