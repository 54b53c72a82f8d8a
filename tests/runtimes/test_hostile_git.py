"""Hostile images and workspaces never make the host's git (or any host-side write) leave them.

Each image is built here with umoci from a layer tarball written by the test (how a publisher
ships one): a real repository at /testbed with links and files planted in its `.git`, in its
hidden paths and in its working directory, all aimed at a *host* repository or folder made
beside it.  The host paths are hashed before and after: prepare, patch and close must leave
them byte for byte as they were, and each refusal must name what it refused.  Before, a `.git`
link made prepare record the host repository's HEAD as the base (and, with a bug patch, write a
commit, objects and an index into it), and a hidden path under a link deleted the host's file.
"""
from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from app.runtimes import RuntimeSetupError
from app.runtimes.oci import OciRuntime
from app.runtimes.patch import PatchError, nested_repositories, patch_from_workspace
from app.runtimes.paths import RuntimePaths
from support.registry import layer_image

pytestmark = pytest.mark.slow

IDENTITY = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_CEILING_DIRECTORIES": str(repo.parent)}
    return subprocess.run(["git", *IDENTITY, "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout


def make_repo(path: Path, files: dict[str, str]) -> str:
    """A git repository at `path` with `files` committed; returns HEAD."""
    path.mkdir(parents=True)
    _git(path, "init", "-q", "-b", "main")
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    _git(path, "add", "-A")
    _git(path, "commit", "-qm", f"commit of {path.name}")
    return _git(path, "rev-parse", "HEAD").strip()


def digest(*paths: Path) -> str:
    """sha256 over every entry under `paths` (name, type, mode, content or link target), links not followed."""
    h = hashlib.sha256()
    for top in paths:
        for folder, dirs, files in os.walk(top):
            dirs.sort()
            for name in sorted(dirs + files):
                p = Path(folder, name)
                st = p.lstat()
                h.update(f"{p}\0{st.st_mode}\0".encode())
                if p.is_symlink():
                    h.update(os.readlink(p).encode())
                elif p.is_file():
                    h.update(p.read_bytes())
    return h.hexdigest()


def image_of(tmp_path: Path, tree: Path, extra: list[tuple[str, str, str]] = (), name: str = "img") -> str:
    """An image whose one layer holds `tree` at /testbed (links kept as links) plus `extra`
    members ("symlink" | "file" | "dir", path, target or text); returns its `oci:` reference."""
    tar_path = tmp_path / f"{name}.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add(tree, arcname="testbed")
        for kind, member, arg in extra:
            info = tarfile.TarInfo(member)
            if kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, arg
                tar.addfile(info)
            elif kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                data = arg.encode()
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return layer_image(tmp_path / f"{name}-layout", tar_path)


def record(ref: str, **extra) -> dict:
    return {"instance_id": "hostile__repo-1", "repo": "hostile/repo", "version": "1", "patch": "x",
            "problem_statement": "p", "FAIL_TO_PASS": ["t.py::test_x"], "PASS_TO_PASS": [],
            "base_commit": "abcdef1", "test_cmd": "pytest", "image": ref, **extra}


@pytest.fixture
def host(tmp_path):
    """A host repository (what an image must never reach) and a host folder, with their digest."""
    head = make_repo(tmp_path / "hostrepo", {"SECRET.txt": "host secret\n", "pkg/host.py": "x = 1\n"})
    folder = tmp_path / "hostdir"
    folder.mkdir()
    (folder / "secret.py").write_text("host file\n")
    return {"repo": tmp_path / "hostrepo", "head": head, "dir": folder,
            "digest": digest(tmp_path / "hostrepo", folder)}


def unchanged(host) -> bool:
    return digest(host["repo"], host["dir"]) == host["digest"]


def src_repo(tmp_path: Path) -> tuple[Path, str]:
    src = tmp_path / "src"
    head = make_repo(src, {"lib.py": "def f():\n    return 1\n", "tests/t.py": "def test_x():\n    pass\n"})
    return src, head


BUG = ("diff --git a/lib.py b/lib.py\n--- a/lib.py\n+++ b/lib.py\n@@ -1,2 +1,2 @@\n def f():\n"
       "-    return 1\n+    return 2\n")


@pytest.mark.parametrize("bug_patch", ["", BUG], ids=["swebench", "swesmith"])
def test_a_dot_git_link_to_a_host_repository_is_refused(tmp_path, host, bug_patch):
    src, _ = src_repo(tmp_path)
    subprocess.run(["rm", "-rf", str(src / ".git")], check=True)
    (src / ".git").symlink_to(host["repo"] / ".git")
    ref = image_of(tmp_path, src)
    with pytest.raises(RuntimeSetupError) as info:
        OciRuntime.prepare(record(ref, bug_patch=bug_patch), paths=RuntimePaths(tmp_path / "var", tmp_path / "cache"))
    assert info.value.stage == "repository" and "/testbed/.git" in str(info.value)
    assert str(host["repo"]) in str(info.value)  # the link's target, named
    assert unchanged(host)


@pytest.mark.parametrize("plant", ["alternates", "commondir", "link-in-objects", "link-head"])
def test_a_git_directory_that_reaches_out_is_refused(tmp_path, host, plant):
    src, _ = src_repo(tmp_path)
    dotgit = src / ".git"
    if plant == "alternates":
        (dotgit / "objects" / "info").mkdir(exist_ok=True)
        (dotgit / "objects" / "info" / "alternates").write_text(str(host["repo"] / ".git" / "objects") + "\n")
    elif plant == "commondir":
        (dotgit / "commondir").write_text(str(host["repo"] / ".git") + "\n")
    elif plant == "link-in-objects":
        (dotgit / "objects" / "zz").symlink_to(host["repo"] / ".git" / "objects")
    else:
        (dotgit / "refs" / "heads" / "main").unlink()
        (dotgit / "refs" / "heads" / "main").symlink_to(host["repo"] / ".git" / "refs" / "heads" / "main")
    ref = image_of(tmp_path, src)
    with pytest.raises(RuntimeSetupError) as info:
        OciRuntime.prepare(record(ref, bug_patch=BUG), paths=RuntimePaths(tmp_path / "var", tmp_path / "cache"))
    assert info.value.stage == "repository"
    assert {"alternates": "alternates", "commondir": "commondir", "link-in-objects": ".git/objects/zz is a link",
            "link-head": ".git/refs/heads/main is a link"}[plant] in str(info.value)
    assert unchanged(host)


def test_a_gitdir_file_resolves_inside_the_image_or_is_refused(tmp_path, host):
    paths = RuntimePaths(tmp_path / "var", tmp_path / "cache")
    src, head = src_repo(tmp_path)
    os.rename(src / ".git", tmp_path / "moved.git")
    (src / ".git").write_text("gitdir: /gitdirs/testbed.git\n")
    inside = tmp_path / "inside"
    inside.mkdir()
    os.rename(tmp_path / "moved.git", inside / "testbed.git")
    # The gitdir lives elsewhere in the image: a second folder of the same layer.
    tar_path = tmp_path / "ok2.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add(src, arcname="testbed")
        tar.add(inside / "testbed.git", arcname="gitdirs/testbed.git")
    ref = layer_image(tmp_path / "ok2-layout", tar_path)
    with OciRuntime.prepare(record(ref, bug_patch=BUG), paths=paths) as rt:
        assert rt.base_commit != head and len(rt.base_commit) == 40  # the bug commit on the image's own HEAD
        assert (rt.workspace / ".git").is_dir() and not (rt.workspace / ".git").is_symlink()  # a copy of its own
        assert "return 2" in (rt.workspace / "lib.py").read_text() and rt.patch() == ""
    (src / ".git").write_text(f"gitdir: {host['repo'] / '.git'}\n")
    with pytest.raises(RuntimeSetupError, match="names no git directory inside the image"):
        OciRuntime.prepare(record(image_of(tmp_path, src, name="out"), bug_patch=BUG), paths=paths)
    assert unchanged(host)


def test_a_hidden_path_under_a_link_to_a_host_folder_is_refused(tmp_path, host):
    src, _ = src_repo(tmp_path)
    (src / "r2e").symlink_to(host["dir"])
    ref = image_of(tmp_path, src)
    paths = RuntimePaths(tmp_path / "var", tmp_path / "cache")
    with pytest.raises(RuntimeSetupError) as info:
        OciRuntime.prepare(record(ref, hidden_paths=["/testbed/r2e/secret.py"]), paths=paths)
    assert info.value.stage == "repository" and "/testbed/r2e/secret.py" in str(info.value)
    assert "r2e is a link" in str(info.value)
    assert unchanged(host) and (host["dir"] / "secret.py").exists()
    # A hidden path that is itself the link: the link goes, what it names stays.
    with OciRuntime.prepare(record(ref, hidden_paths=["/testbed/r2e"]), paths=paths) as rt:
        assert not os.path.lexists(rt.workspace / "r2e")
    assert unchanged(host)


def test_links_in_the_working_directory_take_no_write_out(tmp_path, host):
    """A bug patch that touches a file under the image's link to a host folder is refused by git
    (beyond a symbolic link); the host folder is untouched."""
    src, _ = src_repo(tmp_path)
    (src / "data").symlink_to(host["dir"])
    ref = image_of(tmp_path, src)
    bad = ("diff --git a/data/secret.py b/data/secret.py\n--- a/data/secret.py\n+++ b/data/secret.py\n"
           "@@ -1 +1 @@\n-host file\n+overwritten\n")
    with pytest.raises(RuntimeSetupError) as info:
        OciRuntime.prepare(record(ref, bug_patch=bad), paths=RuntimePaths(tmp_path / "var", tmp_path / "cache"))
    assert info.value.stage == "bug_patch"
    assert unchanged(host)


def test_a_nested_git_in_the_image_or_the_workspace_is_never_opened(tmp_path, host):
    src, head = src_repo(tmp_path)
    (src / "vendor").mkdir()
    (src / "vendor" / ".git").write_text(f"gitdir: {host['repo'] / '.git'}\n")
    (src / "vendor" / "v.py").write_text("v = 1\n")
    ref = image_of(tmp_path, src)
    with OciRuntime.prepare(record(ref, bug_patch=BUG), paths=RuntimePaths(tmp_path / "var", tmp_path / "cache")) as rt:
        (rt.workspace / "agent").mkdir()
        (rt.workspace / "agent" / ".git").symlink_to(host["repo"] / ".git")
        (rt.workspace / "agent" / "a.py").write_text("a = 1\n")
        (rt.workspace / "lib.py").write_text("def f():\n    return 3\n")
        assert nested_repositories(rt.workspace) == ["agent", "vendor"]
        patch = rt.patch()
    assert "+    return 3" in patch
    assert host["head"] not in patch and "Subproject" not in patch and "agent" not in patch
    assert unchanged(host)


def test_a_workspace_without_a_trusted_base_must_keep_its_git_inside(tmp_path, host):
    """The harness check diffs a workspace against its own history: an alternates file or a link
    planted in its `.git` is refused, not followed."""
    ws = tmp_path / "ws"
    make_repo(ws, {"a.py": "a = 1\n"})
    (ws / "a.py").write_text("a = 2\n")
    assert "+a = 2" in patch_from_workspace(ws)
    (ws / ".git" / "objects" / "info" / "alternates").write_text(str(host["repo"] / ".git" / "objects") + "\n")
    with pytest.raises(PatchError, match="alternates"):
        patch_from_workspace(ws)
    (ws / ".git" / "objects" / "info" / "alternates").unlink()
    os.rename(ws / ".git", tmp_path / "ws.git")
    (ws / ".git").symlink_to(host["repo"] / ".git")
    with pytest.raises(PatchError):
        patch_from_workspace(ws)
    assert unchanged(host)


def test_removing_a_workspace_never_changes_what_its_links_name(tmp_path, host):
    """LocalRuntime.close on a workspace where the agent made a folder read-only beside a link to
    a host file: the link goes, the host file keeps its mode (the retry's chmod followed it).
    Run without the capabilities that let root ignore modes (the worker's uid is not root in
    production; here it may be), so the read-only folder really refuses the first unlink."""
    import sys

    ws = tmp_path / "ws"
    (ws / "locked").mkdir(parents=True)
    (ws / "locked" / "link").symlink_to(host["dir"] / "secret.py")
    os.chmod(ws / "locked", 0o555)
    drop = "-dac_override,-dac_read_search,-fowner"
    prefix = ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}"] if os.getuid() == 0 else []
    subprocess.run([*prefix, sys.executable, "-c", "import sys; from pathlib import Path; "
                    "from app.runtimes.images import remove_tree; remove_tree(Path(sys.argv[1]))", str(ws)],
                   check=True, cwd=Path(__file__).resolve().parents[2])
    assert not ws.exists() and unchanged(host)
