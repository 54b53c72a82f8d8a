"""Grade a Harbor task (https://harborframework.com/docs/tasks) in a fresh runtime of its image.

1. The agent's patch (its changes to `repo_dir`) is read, stripped of test-harness changes
   and applied as for every grade (`patching`: a `test.sh` that runs pytest must not meet the
   agent's conftest or `.pth`), with the harness files put back.
2. `/tests` and `/logs/verifier` are fresh host folders mounted over whatever the image has
   there: the task's `tests/` copied into the first (read-only), the second empty, so a reward
   the agent or the image planted is gone before the verifier runs (NeMo Gym's Harbor loader
   empties both for the same reason).  `reward.txt` and `reward.json` are files of ours bound
   over `/logs/verifier/<name>` and watched (`reward_watch.RewardWatch`).
3. `bash /tests/test.sh` runs in `repo_dir` with `[verifier] env`, no network whatever
   `network_mode` says, and the runtime's own time limit of `timeout_sec` (no in-image
   `timeout`: a process whose exit status the tested code could change).  The bash is an
   execute-only copy of the image's own, so the kernel makes the shell non-dumpable: no
   process of the tested code can ptrace it or open its /proc/PID/mem, environ or fds.
4. The reward is the one file the verifier wrote once (`RewardWatch.verdict`), read by
   `verifier.read_reward`; resolved when it is at least 1.  A verifier that exits non-zero, is
   killed by a signal or times out, a reward not written exactly once by one write session, an
   image without bash or without git and GNU patch: `VerifierError` (masked, never reward 0).

**What the tested code can and cannot do.**  `test.sh` runs the agent's patched code (the
library its tests import) in the shell's own sandbox, uid and namespaces, so that code can do
whatever the shell can, except what this grade closes:

* it cannot leave a reward standing by writing the file and stopping the shell (a kill, a
  stop until the time limit, a crash of `set -e`): the exit status is the shell's, and only 0
  is read;
* it cannot write the reward in the shell's place, before or after the shell's own write,
  through any path or a descriptor it kept: every open, write and close on the inode is seen,
  and two writes are a verifier error;
* it cannot make the shell's write fail and leave its own (read-only mode: a mode change is
  seen; a folder, FIFO, link or hard link in place of the file: the file is a mount point);
* it cannot rewrite what the shell reads next (`/tests` is read-only), nor reach into the
  shell (non-dumpable).

It can still: make every grade a verifier error (write the reward itself, and the grade is
masked, never paid); change what a *later* command of `test.sh` runs when that command reads
a writable place (HOME, /tmp, a cache), which is the task's verifier to guard; and slip a write
between the shell's write and close from a descriptor opened in the same instant, which
inotify reports as one session (a race of microseconds against a shell that writes and closes
in one redirection).

`oracle_patch(record)` runs `solution/solve.sh` in a fresh episode runtime and returns the
patch it leaves in `repo_dir`: the gold patch `tasks validate` grades.  Changes a solution
makes outside `repo_dir` are not carried into grading (grading runs in a fresh runtime).
"""
from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from app.config import Settings
from app.grading.outcome import GradeResult, grade_log_path, patch_sha256
from app.grading.patching import PatchReadError, apply_script, drop_test_changes, read_patch
from app.grading.reward_watch import RewardWatch
from app.grading.steps import (GRADING_DIR, RuntimeFactory, apply_failure_reason, check_tools, default_runtime_factory,
                               find_tampering, probe_test_env, restore_test_harness)
from app.grading.verifier import TOOL_PATH, VerifierError, read_reward
from app.runtimes.paths import RuntimePaths
from app.runtimes.sandbox import Mount
from app.tasksets.schema import InstanceRecord

TESTS, VERIFIER_LOGS, SOLUTION = "/tests", "/logs/verifier", "/solution"
VERIFIER_SHELL = "/run/turnstile/verifier/bash"


def fresh_verifier_dirs(root: Path, tests_src: Path) -> tuple[Path, Path]:
    """(tests, verifier logs) host folders under `root`, made anew: `tests_src` copied (links kept as
    links, never followed) into the first, the second empty.  Anything there before is removed."""
    tests, logs = root / "tests", root / "verifier"
    for d in (tests, logs):
        if d.exists() or d.is_symlink():
            shutil.rmtree(d) if d.is_dir() and not d.is_symlink() else d.unlink()
    shutil.copytree(tests_src, tests, symlinks=True)
    logs.mkdir()
    return tests, logs


def verifier_shell(rootfs: Path, folder: Path) -> Path:
    """An execute-only (mode 0111) copy of the image's bash in `folder`: exec of a file its
    process cannot read makes that process non-dumpable (execve(2), `would_dump`), so the tested
    code cannot ptrace the shell or open its /proc/PID/mem.  Raises `VerifierError` without one."""
    from app.runtimes.rootfs import resolve_inside

    found = next((p for d in TOOL_PATH if (p := resolve_inside(rootfs, f"{d}/bash")) is not None and p.is_file()), None)
    if found is None:
        raise VerifierError("the image has no bash on its PATH, which runs Harbor's tests/test.sh")
    folder.mkdir()
    shell = folder / "bash"
    shutil.copyfile(found, shell)
    os.chmod(shell, 0o111)
    return shell


def exit_words(code: int) -> str:
    """`exited 3`, or `was killed by SIGKILL` for the shell's 128+N (a sandbox's init reports so)."""
    if code > 128 and code - 128 in signal.Signals._value2member_map_:
        return f"was killed by {signal.Signals(code - 128).name}"
    return f"exited {code}"


def grade_harbor(record: InstanceRecord, patch: str, *, settings: Settings,
                 runtime_factory: RuntimeFactory | None = None) -> GradeResult:
    """Grade `patch` on a Harbor `record` (module docstring).  Raises `VerifierError`, `RuntimeSetupError`."""
    assert record.harbor is not None
    h = record.harbor
    t0 = time.monotonic()
    prepare = runtime_factory or default_runtime_factory()
    paths = RuntimePaths.from_settings(settings)
    log_path = grade_log_path(paths, record, patch)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"patch_sha256": patch_sha256(patch), "image": record.image, "grader": "harbor",
                              "dropped_test_files": [], "reverted_files": {}}
    try:
        strip = read_patch(patch).strip
        kept, report["dropped_test_files"] = drop_test_changes(patch, [], "", [])
    except PatchReadError as exc:
        log_path.write_text(f"{exc}\n", encoding="utf-8")
        report["apply"] = {"applied": False, "method": None, "reason": f"patch refused: {exc}; log: {log_path}"}
        return GradeResult(False, 0.0, report, str(log_path))
    apply_info = {"applied": not kept, "method": None if kept else "empty patch", "reason": None}
    parts: list[str] = []
    with prepare(record, settings=settings, paths=paths, purpose="grade") as rt:
        check_tools(rt, record)
        gdir = rt.root / "grading"
        gdir.mkdir()
        (gdir / "patch.diff").write_text(kept, encoding="utf-8", errors="surrogateescape")
        (gdir / "apply.sh").write_text(apply_script(f"{GRADING_DIR}/patch.diff", strip))
        grading = [Mount(gdir, GRADING_DIR, False)]
        if kept:
            env = probe_test_env(rt, lambda script: f"bash {GRADING_DIR}/{script} 2>&1", grading)
            res = rt.run(f"bash {GRADING_DIR}/apply.sh 2>&1", timeout_s=300, extra_mounts=grading)
            parts.append(res.stdout)
            if res.ok:
                apply_info.update(applied=True, method=res.stdout.strip().splitlines()[-1].partition("(")[2].rstrip(")"))
                report["reverted_files"] = restore_test_harness(rt, set(), env)
                report["tampering"] = find_tampering(rt, set(), env)
            else:
                apply_info.update(applied=False, reason=apply_failure_reason(res.exit_code, res.stdout, log_path))
        report["apply"] = apply_info
        if not apply_info["applied"]:
            log_path.write_text("".join(parts), encoding="utf-8", errors="replace")
            return GradeResult(False, 0.0, report, str(log_path))
        tests, logs = fresh_verifier_dirs(rt.root, Path(h.tests_dir))
        shell = verifier_shell(rt.rootfs, rt.root / "verifier-shell")
        t1 = time.monotonic()
        with RewardWatch(rt.root / "reward", VERIFIER_LOGS) as watch:
            mounts = [Mount(tests, TESTS, False), Mount(logs, VERIFIER_LOGS, True), *watch.mounts(),
                      Mount(shell, VERIFIER_SHELL, False)]
            res = rt.run([VERIFIER_SHELL, f"{TESTS}/test.sh"], env=h.verifier_env, timeout_s=h.verifier_timeout_s,
                         extra_mounts=mounts, workdir=record.repo_dir)
            watch.stop()
        parts.append(f"$ bash {TESTS}/test.sh (exit {res.exit_code}, {res.duration_s:.1f} s)\n{res.stdout}\n"
                     f"--- stderr ---\n{res.stderr}\n--- reward file events ---\n{watch.events}\n")
        log_path.write_text("".join(parts), encoding="utf-8", errors="replace")
        report.update(verifier_exit_code=res.exit_code, verifier_timed_out=res.timed_out,
                      network="none", task_network_mode=h.network_mode,
                      timings={"verifier_s": round(time.monotonic() - t1, 3), "total_s": round(time.monotonic() - t0, 3)})
        where = f"instance {record.instance_id}"
        if res.timed_out:
            raise VerifierError(f"{where}: test.sh ran past its {h.verifier_timeout_s:g} s (log {log_path})")
        if res.exit_code != 0:
            raise VerifierError(f"{where}: test.sh {exit_words(res.exit_code)}, so its reward is not its own "
                                f"(log {log_path})")
        try:
            reward, details = read_reward(watch.folder, watch.verdict())
        except VerifierError as exc:
            raise VerifierError(f"{where}: {exc} (log {log_path})") from None
    report["reward_file"] = details
    # Code under test that reached into the test framework never passes, whatever test.sh reported,
    # and earns nothing: the reward (not the resolved flag) is what GRPO trains on.
    if report.get("tampering"):
        report["verifier_reward"] = reward
        reward = 0.0
    resolved = reward >= 1.0
    report["resolved"] = resolved
    return GradeResult(resolved, reward, report, str(log_path))


def oracle_patch(record: InstanceRecord, *, settings: Settings, runtime_factory: RuntimeFactory | None = None,
                 timeout_s: float | None = None) -> str:
    """The changes `solution/solve.sh` makes to `repo_dir`, run in a fresh runtime (no network).

    Raises `VerifierError` when the task has no oracle or it fails (exit status and output named).
    """
    h = record.harbor
    if h is None or not h.oracle:
        raise VerifierError(f"instance {record.instance_id} has no solution/solve.sh")
    prepare = runtime_factory or default_runtime_factory()
    solution = Path(h.oracle).parent
    with prepare(record, settings=settings, purpose="oracle") as rt:
        check_tools(rt, record)
        res = rt.run(["bash", f"{SOLUTION}/solve.sh"], timeout_s=timeout_s or h.agent_timeout_s or 600,
                     extra_mounts=[Mount(solution, SOLUTION, False)], workdir=record.repo_dir)
        if not res.ok:
            raise VerifierError(f"instance {record.instance_id}: solution/solve.sh failed (exit {res.exit_code}): "
                                f"{(res.stderr or res.stdout).strip()[-500:]}")
        return rt.patch()
