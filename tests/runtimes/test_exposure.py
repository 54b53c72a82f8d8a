"""What a sandbox shows of the host: no installed copy of a task's package, no fixed source.

The scan: for every instance of a bundled task set (the downloaded `synthetic` set and the
generated `starter` set) the files its gold patch produces are hashed on the host; then one
episode sandbox per set (a real LocalRuntime under bubblewrap, the set's first instance) runs a
small scanner over every regular file it can read, every blob of every git repository it finds
and every member of every wheel/zip/egg (under a size cap).  It reports a file whose bytes equal
a gold-patched file (read when its size is one of theirs: hash matching), and a file named like
one (any version of the package: `__init__.py`, `strutils.py`) that holds every fixed line of a
gold hunk (its added and context lines, for hunks whose lines are not all in the buggy file).
None may be found.  On a host with the Google Cloud SDK the pristine `inflection`
(vendored under /usr/lib/google-cloud-sdk/platform/bq/third_party) was readable before /usr was
allowlisted.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import unidiff

from app.runtimes import LocalRuntime, RuntimePaths, bwrap_available, exposure
from app.runtimes.materialize import materialize_base
from app.tasksets import load_task_set

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap (Debian package `bubblewrap`) is not installed/usable here")

SIZE_CAP = 1 << 20  # bytes: no gold-patched file of the bundled sets is near this

SCANNER = r'''
import hashlib, json, os, subprocess, sys, zipfile
t = json.load(open(sys.argv[1]))
want, sizes, names, cap = set(t["hashes"]), set(t["sizes"]), set(t["names"]), t["cap"]
hunks = [(h["id"], set(h["lines"])) for h in t["hunks"]]
# The episode's own repository holds the other instances' fixes of its package (their bugs are
# not its bug): there only its own instance's hunks count.
own = [(hid, need) for hid, need in hunks if hid.startswith(t["own"] + ":")]
def check(where, name, size, read, found):
    if size > cap:
        return
    by_size, by_name = size in sizes, name in names
    if not (by_size or by_name):
        return
    data = read()
    if by_size and hashlib.sha256(data).hexdigest() in want:
        found.append(f"{where} (the whole gold-patched file)")
    if by_name:
        lines = {line.strip() for line in data.decode("utf-8", "replace").splitlines()}
        judged = own if where.startswith(t["workspace"]) else hunks
        found += [f"{where} (holds the fixed lines of {hid})" for hid, need in judged if need <= lines]
found, files, repos = [], 0, []
for top, dirs, entries in os.walk("/"):
    if top in ("/proc", "/sys", "/dev"):
        dirs[:] = []
        continue
    if ".git" in dirs:
        repos.append(top)
    for n in entries:
        p = os.path.join(top, n)
        try:
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            files += 1
            size = os.path.getsize(p)
            if n.endswith((".whl", ".zip", ".egg")) and size <= 64 * cap:
                with zipfile.ZipFile(p) as z:
                    for info in z.infolist():
                        check(f"{p}!{info.filename}", os.path.basename(info.filename), info.file_size,
                              lambda: z.read(info), found)
                continue
            check(p, n, size, lambda: open(p, "rb").read(), found)
        except Exception:
            continue
names.add("*")  # a blob has no name: every one is read
for repo in repos:  # every object of every repository, whatever its name in the tree
    out = subprocess.run(["git", "-C", repo, "cat-file", "--batch-all-objects", "--batch"], capture_output=True).stdout
    i = 0
    while i < len(out):
        end = out.index(b"\n", i)
        sha, kind, size = out[i:end].split()
        body = out[end + 1:end + 1 + int(size)]
        if kind == b"blob":
            check(f"{repo}/.git:{sha.decode()}", "*", len(body), lambda: body, found)
        i = end + 1 + int(size) + 1
print(json.dumps({"found": found, "files": files, "repos": repos}))
'''



def gold_files(records, paths: RuntimePaths) -> tuple[dict[str, bytes], list[dict]]:
    """({"<instance>:<path>": bytes} of every file each record's gold patch writes (applied to its
    base), [{"id", "lines"}] of each gold hunk whose fixed lines (added and context, stripped) are
    not all in the base file: a file holding them all holds the fix)."""
    out: dict[str, bytes] = {}
    hunks: list[dict] = []
    for rec in records:
        base = materialize_base(rec, paths)
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp) / "w"
            shutil.copytree(base, work, symlinks=True, ignore=shutil.ignore_patterns(".git"))
            subprocess.run(["git", "init", "-q", str(work)], check=True)
            proc = subprocess.run(["git", "-C", str(work), "apply", "--numstat", "--apply", "-"],
                                  input=rec.patch, capture_output=True, text=True)
            assert proc.returncode == 0, (rec.instance_id, proc.stderr)
            for line in proc.stdout.splitlines():
                rel = line.split("\t", 2)[2]
                if (work / rel).is_file():
                    out[f"{rec.instance_id}:{rel}"] = (work / rel).read_bytes()
        for pf in unidiff.PatchSet(rec.patch):
            before = base / pf.path
            old = {x.strip() for x in before.read_text(errors="replace").splitlines()} if before.is_file() else set()
            for k, hunk in enumerate(pf):
                lines = {str(x.value).strip() for x in hunk if (x.is_added or x.is_context) and str(x.value).strip()}
                if any(x.is_added and str(x.value).strip() for x in hunk) and not lines <= old:
                    hunks.append({"id": f"{rec.instance_id}:{pf.path}#{k}", "lines": sorted(lines)})
    return out, hunks


@pytest.mark.parametrize("task_set", ["synthetic", "starter"])
def test_no_gold_patched_file_is_readable_inside_an_episode_sandbox(settings, task_set):
    ts = load_task_set(task_set)
    paths = RuntimePaths.from_settings(settings)
    gold, hunks = gold_files(ts.instances, paths)
    assert len(gold) >= len(ts.instances) and len(hunks) >= len(ts.instances), (len(gold), len(hunks))
    targets = {"hashes": sorted({hashlib.sha256(b).hexdigest() for b in gold.values()}),
               "sizes": sorted({len(b) for b in gold.values()}), "cap": SIZE_CAP, "hunks": hunks,
               "names": sorted({key.rsplit("/", 1)[-1].split(":", 1)[-1] for key in gold}),
               "own": ts.instances[0].instance_id, "workspace": "/testbed"}
    with LocalRuntime.prepare(ts.instances[0], settings=settings) as rt:
        (rt.home / "targets.json").write_text(json.dumps(targets))
        (rt.home / "scan.py").write_text(SCANNER)
        res = rt.run(f"python {rt.home_dir}/scan.py {rt.home_dir}/targets.json", timeout_s=300)
    assert res.exit_code == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["files"] > 1000 and "/testbed" in report["repos"], report  # it did read the sandbox
    assert report["found"] == [], report["found"]


def test_python_trees_are_hidden_at_the_highest_level_that_is_not_needed(tmp_path):
    """A fake /usr: Debian's dist-packages, an SDK vendoring a package, a pip install, a loose
    module among programs, a compiler tree with Python tools; programs, libraries and the
    standard library stay."""
    usr = tmp_path / "usr"
    for rel in ("lib/python3/dist-packages/inflection/__init__.py", "lib/sdk/platform/third_party/toolz/__init__.py",
                "lib/sdk/bin/sdk", "local/lib/python3.11/dist-packages/boltons/__init__.py",
                "lib/python3.11/json/__init__.py", "lib/python3.11/site-packages/humanize/__init__.py",
                "lib/x86_64-linux-gnu/libz.so.1", "lib/x86_64-linux-gnu/gtk/plugins/mod.py", "bin/ls", "bin/tool.py",
                "lib/llvm-14/bin/clang", "lib/llvm-14/build/lit/lit.py", "share/doc/git/examples/x.py",
                "share/zoneinfo/UTC", "lib/git-core/git-p4"):
        (usr / rel).parent.mkdir(parents=True, exist_ok=True)
        (usr / rel).write_text("x")
    exposure.forget()
    dirs, files = exposure.hidden_paths(usr)
    rel = lambda p: str(Path(p).relative_to(usr))  # noqa: E731
    assert sorted(map(rel, dirs)) == ["lib/llvm-14/build", "lib/python3", "lib/python3.11/site-packages", "lib/sdk",
                                      "lib/x86_64-linux-gnu/gtk", "local/lib/python3.11/dist-packages",
                                      "share/doc"]
    assert list(map(rel, files)) == ["bin/tool.py"]
    args = exposure.usr_args(str(usr))
    assert ["--ro-bind", str(usr / "bin"), "/usr/bin"] == args[6:9] and args[-2:] == ["--remount-ro", "/usr"]
    assert "/usr/lib/sdk" in args and "/usr/bin/tool.py" in args and "/usr/lib/python3.11/json" not in args
    exposure.forget()
