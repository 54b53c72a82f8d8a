"""Patch extraction against agent-written git attributes and links out of the repository.

Real git on real workspaces: the base repository is committed, the workspace is its copy with
the agent's edits.  Before, a `.gitattributes` with `working-tree-encoding` made `git add` raise
(the episode was failed and left out of its group), and `text`/`ident` attributes changed the
patch's bytes from the files'; a link to a host file was extracted and graded as a change.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from app.grading.patching import PatchReadError, read_patch
from app.runtimes.patch import PatchRefused, escaping_symlinks, patch_from_workspace


def _repo(tmp_path: Path) -> tuple[Path, Path]:
    base = tmp_path / "base"
    base.mkdir()
    (base / "a.txt").write_text("hello\n")
    (base / "pkg").mkdir()
    (base / "pkg" / "m.py").write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(base)]
    subprocess.run(["git", "init", "-q", str(base)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    ws = tmp_path / "ws"
    shutil.copytree(base, ws, symlinks=True)
    return base, ws


def test_agent_written_git_attributes_change_nothing_in_the_patch(tmp_path):
    base, ws = _repo(tmp_path)
    (ws / ".gitattributes").write_text("*.txt working-tree-encoding=UTF-16\n*.py text eol=crlf ident filter=x\n")
    (ws / ".git" / "info").mkdir(exist_ok=True)
    (ws / ".git" / "info" / "attributes").write_text("* -diff\n")
    (ws / "a.txt").write_text("changed\n")
    (ws / "pkg" / "m.py").write_bytes(b'x = "$Id$"\r\n')
    for base_repo in (base, None):  # the trusted base's objects, or the workspace's own
        patch = patch_from_workspace(ws, None, base_repo=base_repo)
        assert "-hello\n+changed\n" in patch
        assert '+x = "$Id$"\r\n' in patch and "Binary" not in patch  # bytes as written: no eol, ident, diff attr


def test_a_link_out_of_the_workspace_is_refused_one_inside_is_kept(tmp_path):
    base, ws = _repo(tmp_path)
    (ws / "pkg" / "inside.py").symlink_to("m.py")
    assert "new file mode 120000" in patch_from_workspace(ws, None, base_repo=base)
    (ws / "pkg" / "fix.py").symlink_to("/usr/lib/python3/dist-packages/pkg/m.py")
    (ws / "up").symlink_to("../../etc")
    with pytest.raises(PatchRefused, match="points outside the repository.*pkg/fix.py -> /usr/lib"):
        patch_from_workspace(ws, None, base_repo=base)


LINK = ("diff --git a/pkg/m.py b/pkg/m.py\ndeleted file mode 100644\n--- a/pkg/m.py\n+++ /dev/null\n@@ -1 +0,0 @@\n"
        "-x = 1\ndiff --git a/pkg/m.py b/pkg/m.py\nnew file mode 120000\n--- /dev/null\n+++ b/pkg/m.py\n@@ -0,0 +1 @@\n"
        "+{target}\n\\ No newline at end of file\n")


@pytest.mark.parametrize("target, escapes", [("/usr/lib/google-cloud-sdk/x/inflection/__init__.py", True),
                                             ("../../outside.py", True), ("../pkg/other.py", False),
                                             ("other.py", False)])
def test_grading_refuses_a_patch_whose_link_points_outside(target, escapes):
    patch = LINK.format(target=target)
    assert bool(escaping_symlinks(patch)) is escapes
    if escapes:
        with pytest.raises(PatchReadError, match="symbolic link that points outside"):
            read_patch(patch)
    else:
        assert [f.new for f in read_patch(patch).files] == [None, "pkg/m.py"]
