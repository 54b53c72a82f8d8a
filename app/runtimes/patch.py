"""Extract an episode's patch: `git diff` of the workspace against the base commit, new files included.

The workspace is agent-controlled, and so is everything git would read from it: its `.git`
(config naming an fsmonitor hook, a diff driver or a clean filter, which git would run *on
the host*; `info/attributes`) and the `.gitattributes` files of its tree (a
`working-tree-encoding` that makes `git add` fail, `text`/`eol`/`ident`/`filter` conversions
that make the patch differ from the files).  So git runs with a private, throwaway git
directory: the trusted base repository's objects (or, without one, the workspace's) as
alternates, a throwaway index, our own config (every other config file switched off:
GIT_CONFIG_NOSYSTEM, GIT_CONFIG_GLOBAL=/dev/null, `core.attributesFile=/dev/null`,
GIT_ATTR_NOSYSTEM) and an `info/attributes` that resets every content-changing attribute to
unspecified for every path.  `$GIT_DIR/info/attributes` outranks every `.gitattributes` in the
tree (https://git-scm.com/docs/gitattributes#_description), so no file the agent writes
changes what git reads or how it diffs (git 2.39 has no `--attr-source`; this works on any git).

No link, `.git` or git config of the workspace or the image takes git out of them
(`app.runtimes.rootfs`'s rule): git's repository is always the private one above (`GIT_DIR`,
`GIT_WORK_TREE` explicit, `image_git.HARDENED_GIT_ENV`); without a trusted base repository the
workspace's own `.git` must pass `image_git.check_git_dir` (no link, alternates or commondir) and
its HEAD is read in Python.  A `.git` below the top of the workspace (a nested repository: git
would open the repository it names, a host one through a link or a `gitdir:` file, and record its
HEAD as a submodule) is kept out of git's walk (`nested_repositories`), and the base's submodule
entries are marked unchanged, so git never opens a repository they name.

By-products never enter the patch: the base's `.git/info/exclude` carries the by-product patterns
(`gitutil.write_excludes`: build folders, caches, egg-info), and `extra_excludes` (a gitignore-format
file, e.g. files the venv install left in the tree) is added on top.

A patch that adds a symbolic link pointing outside the repository (an absolute target, or one
that climbs out with `..`) is refused (`PatchRefused`, `escaping_symlinks`): through it the
tests would read a host file, e.g. a pristine copy of the package under test.  The grader
refuses such a patch by the same rule (`app.grading.patching.read_patch`).
"""
from __future__ import annotations

import os
import posixpath
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from app.gitutil import git_env
from app.runtimes.errors import RuntimeSetupError
from app.runtimes.image_git import HARDENED_GIT_ENV, check_git_dir, head_commit

# Config that decides what a diff looks like or runs a program, pinned on the command
# line, which wins over every config file (https://git-scm.com/docs/git#Documentation/git.txt--cltnamegtltvaluegt).
HARDENED_GIT_OPTIONS = ("-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", "-c", "diff.external=",
                        "-c", "core.quotePath=false", "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false",
                        "-c", "diff.relative=false", "-c", "core.autocrlf=false", "-c", "core.safecrlf=false",
                        "-c", "core.symlinks=true", "-c", "core.ignoreCase=false",
                        "-c", f"core.attributesFile={os.devnull}")
# The diff options that fix its format whatever the config says.
DIFF_FORMAT_OPTIONS = ("--binary", "--no-color", "--no-ext-diff", "--no-textconv", "--no-relative",
                       "--src-prefix=a/", "--dst-prefix=b/")
# Every attribute that changes what `git add` stores or how `git diff` prints it, reset to
# unspecified (`!attr`: as if no .gitattributes named it) for every path
# (https://git-scm.com/docs/gitattributes: text, eol, crlf, working-tree-encoding, filter, ident, diff).
NEUTRAL_ATTRIBUTES = "* !text !eol !crlf !working-tree-encoding !filter !ident !diff !merge !whitespace\n"
SYMLINK_MODE = "120000"
GITLINK_MODE = "160000"


class PatchError(RuntimeError):
    """git could not compute the diff (message has git's stderr)."""


class PatchRefused(PatchError):
    """The diff was computed but is not accepted (a symbolic link out of the repository); the
    message says which path and why."""


def patch_from_workspace(
    workspace: Path,
    base_commit: str | None = None,
    *,
    base_repo: Path | None = None,
    extra_excludes: Path | None = None,
) -> str:
    """Unified diff (text, `git diff --binary` format, a/ b/ prefixes) of `workspace` against `base_commit`.

    `base_commit` defaults to the root commit of the history (the single sdist
    commit).  Added, deleted, modified and mode-changed files are included; ignored
    files are not.  Returns "" when nothing changed.  Raises `PatchError` when git fails,
    `PatchRefused` for a symbolic link that points outside the repository.
    """
    workspace = Path(workspace)
    source = Path(base_repo) if base_repo is not None else workspace
    try:
        if base_repo is None:
            check_git_dir(workspace / ".git")
        head = head_commit(source / ".git") if base_commit is None else base_commit
    except RuntimeSetupError as exc:
        raise PatchError(f"the git history of {source} cannot be used: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="turnstile-diff-") as tmp:
        gitdir = _private_git_dir(Path(tmp), source / ".git")
        with open(gitdir / "info" / "exclude", "a", encoding="utf-8") as fh:
            fh.write("".join(f"{gitignore_literal(p)}/\n" for p in nested_repositories(workspace)))
        env = git_env({**HARDENED_GIT_ENV, "GIT_DIR": str(gitdir), "GIT_WORK_TREE": str(workspace),
                       "GIT_INDEX_FILE": os.path.join(tmp, "index"), "GIT_ATTR_NOSYSTEM": "1",
                       "GIT_CEILING_DIRECTORIES": str(workspace.resolve().parent)})
        opts = list(HARDENED_GIT_OPTIONS)
        if extra_excludes is not None and Path(extra_excludes).is_file():
            opts += ["-c", f"core.excludesFile={extra_excludes}"]

        def run(*args: str, stdin: bytes | None = None) -> str:
            proc = subprocess.run(["git", *opts, *args], cwd=workspace, env=env, capture_output=True, input=stdin)
            if proc.returncode != 0:
                raise PatchError(f"git {args[0]} failed: {proc.stderr.decode(errors='replace').strip()[-2000:]}")
            return proc.stdout.decode("utf-8", errors="surrogateescape")

        if base_commit is None:
            base_commit = run("rev-list", "--max-parents=0", head).split()[-1]
        run("read-tree", base_commit)
        # Submodule entries of the base: git would open the repository the workspace's `.git`
        # there names to compare its HEAD; marked unchanged, it is never looked at.
        gitlinks = [line.split("\t", 1)[1] for line in run("ls-files", "-s", "-z").split("\0")
                    if line.startswith(GITLINK_MODE + " ")]
        if gitlinks:
            run("update-index", "--assume-unchanged", "-z", "--stdin",
                stdin=b"".join(p.encode("utf-8", "surrogateescape") + b"\0" for p in gitlinks))
        run("add", "-A", "--", ".")
        diff = run("diff", "--cached", *DIFF_FORMAT_OPTIONS, base_commit)
    escapes = escaping_symlinks(diff)
    if escapes:
        raise PatchRefused(symlink_refusal(escapes))
    return diff


def _private_git_dir(tmp: Path, trusted: Path) -> Path:
    """A git directory under `tmp` that reads objects from `trusted` (alternates) and holds only
    our own config, excludes (copied from `trusted`) and the neutral attributes."""
    gitdir = tmp / "git"
    (gitdir / "objects" / "info").mkdir(parents=True)
    (gitdir / "refs").mkdir()
    (gitdir / "info").mkdir()
    (gitdir / "HEAD").write_text("ref: refs/heads/main\n")
    (gitdir / "config").write_text("[core]\n\trepositoryformatversion = 0\n\tbare = false\n")
    (gitdir / "objects" / "info" / "alternates").write_text(str((trusted / "objects").resolve()) + "\n")
    (gitdir / "info" / "attributes").write_text(NEUTRAL_ATTRIBUTES)
    for name in ("info/exclude", "shallow"):
        src = trusted / name
        if src.is_file() and not src.is_symlink():
            shutil.copyfile(src, gitdir / name)
    return gitdir


def nested_repositories(tree: Path) -> list[str]:
    """Folders of `tree` (POSIX paths relative to it) that hold a `.git` entry of any kind (folder,
    file, link), below the top; links are not followed (`find -P`), unreadable folders skipped."""
    tree = Path(tree)
    proc = subprocess.run(["find", "-P", str(tree), "-path", str(tree / ".git"), "-prune", "-o",
                           "-name", ".git", "-prune", "-print0"], capture_output=True)
    # A folder find cannot open (the agent's chmod 000) is one git cannot open either: its
    # answer for the rest stands.
    found = [os.fsdecode(p) for p in proc.stdout.split(b"\0") if p]
    return sorted(os.path.relpath(os.path.dirname(p), tree).replace(os.sep, "/") for p in found)


def gitignore_literal(path: str) -> str:
    """A gitignore line that names exactly `path` (relative, POSIX) from the top: `/` anchored,
    every pattern character escaped (https://git-scm.com/docs/gitignore#_pattern_format)."""
    if "\n" in path:
        raise PatchRefused(f"the path {path!r} has a newline, which no gitignore line can name")
    escaped = re.sub(r"([\\*?\[!#])", r"\\\1", path)
    return "/" + re.sub(r" +$", lambda m: "\\ " * len(m.group()), escaped)


_DIFF_GIT = re.compile(r"^diff --git \"?a/(.*?)\"? \"?b/(.*?)\"?$")


def escaping_symlinks(patch: str) -> list[tuple[str, str]]:
    """(link path, target) of every symbolic link the patch creates or changes (git's mode 120000)
    whose target is absolute or resolves outside the repository from the link's folder
    (`link_escapes`).  Reads git-format sections (`diff --git a/... b/...`); other patch formats
    cannot create links.
    """
    out: list[tuple[str, str]] = []
    sections = re.split(r"(?m)^(?=diff --git )", patch)
    for section in sections:
        m = _DIFF_GIT.match(section.split("\n", 1)[0])
        if m is None:
            continue
        target = symlink_target(section)
        if target is not None and link_escapes(m.group(2), target):
            out.append((m.group(2), target))
    return out


def symlink_target(section: str) -> str | None:
    """The target of the symbolic link one file's section of a git patch creates or changes (its
    `new file mode 120000` / `new mode 120000` header, the target being the hunk's added line), or
    None when the section leaves no link."""
    link = in_hunk = False
    target: list[str] = []
    for line in section.splitlines():
        if not in_hunk and line.startswith(("new file mode ", "new mode ")):
            link = line.split()[-1] == SYMLINK_MODE
        elif line.startswith("@@ "):
            in_hunk = True
        elif in_hunk and line.startswith("+"):
            target.append(line[1:])
    return "".join(target) if link else None


def link_escapes(link: str, target: str) -> bool:
    """True when a link at repository path `link` with `target` points outside the repository:
    an absolute target, or a relative one that climbs above the root from the link's folder."""
    if not target or target.startswith("/") or "\0" in target:
        return True
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(link), target))
    return resolved == ".." or resolved.startswith("../")


def symlink_refusal(escapes: list[tuple[str, str]]) -> str:
    """The one-line reason a patch with these escaping links is refused."""
    shown = ", ".join(f"{p} -> {t}" for p, t in escapes[:5])
    more = f" and {len(escapes) - 5} more" if len(escapes) > 5 else ""
    return (f"the patch adds a symbolic link that points outside the repository ({shown}{more}): "
            "a link out of the workspace is not a source change")
