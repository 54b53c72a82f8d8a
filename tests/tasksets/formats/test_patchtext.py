"""Reverse patches and R2E-Gym parsed commits, checked with real git."""
import json
import subprocess

from app.tasksets.formats.patchtext import r2e_commit_patch, reverse_patch
from support.format_fixtures import format_fixtures


def _git(cwd, *args, **kw):
    return subprocess.run(["git", "-C", str(cwd), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True, **kw)


def test_reverse_patch_undoes_edits_additions_and_deletions(tmp_path):
    repo = tmp_path / "r"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("one\ntwo\nthree\n")
    (repo / "gone.py").write_text("bye\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    (repo / "a.py").write_text("one\nTWO\nthree\nfour\n")
    (repo / "gone.py").unlink()
    (repo / "new.py").write_text("hi\n")
    _git(repo, "add", "-A")
    forward = _git(repo, "diff", "--cached").stdout
    _git(repo, "commit", "-qm", "change")
    _git(repo, "apply", "-", input=reverse_patch(forward))
    assert (repo / "a.py").read_text() == "one\ntwo\nthree\n"
    assert (repo / "gone.py").read_text() == "bye\n" and not (repo / "new.py").exists()


def test_r2e_commit_patch_splits_code_from_tests(tmp_path):
    row = json.loads((format_fixtures(tmp_path / "f") / "r2egym.jsonl").read_text())
    parsed = json.loads(row["parsed_commit_content"])
    code = r2e_commit_patch(parsed, test_files=False)
    tests = r2e_commit_patch(parsed, test_files=True)
    assert code.startswith("diff --git a/requests/structures.py") and "tests/" not in code
    assert tests.startswith("diff --git a/tests/test_structures.py")
    assert "+    def __contains__(self, key):\n" in code
