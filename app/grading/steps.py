"""The steps every grade runs in its runtime, whichever grader drives it: apply the patch
(`apply_then_eval`), probe the test environment first (`probe_test_env`), put back the test
harness the applied tree still changes (`restore_test_harness`), find kept code that reaches into
the test framework (`find_tampering`), then run the eval script; and the image runtime the image
graders (`image`, `harbor`) prepare and check (`default_runtime_factory`, `check_tools`).
"""
from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any, Callable

from app.gitutil import git
from app.grading import reach, surface, testcode
from app.grading.patching import APPLY_CMDS, read_patch
from app.grading.verifier import REQUIRED_TOOLS, VerifierError, missing_tools
from app.runtimes.errors import RuntimeSetupError
from app.tasksets.schema import InstanceRecord
from app.tasksets.swebench_compat import grading_module

log = logging.getLogger(__name__)

GRADING_DIR = "/run/turnstile/grading"


def apply_then_eval(rt: Any, command: Callable[[str], str | list[str]], mounts: list, kept: str, protected: set[str],
                    log_path: Path, timeout_s: float, apply_info: dict, report_extra: dict, parts: list[str],
                    test_patch: str = "") -> float:
    """Run `apply.sh` (when a patch is kept) then `eval.sh` in `rt`, as swebench's `run_instance` does.

    `command(script)` is the argv (or shell line) that runs a script of the grading folder in `rt`.
    Before the patch is applied, the test environment's importable names are probed
    (`probe_test_env`).  Updates `apply_info` (applied, method or reason),
    `report_extra["reverted_files"]` (test-harness files the patch touched, restored after it
    applied: `restore_test_harness`) and `report_extra["tampering"]` ({path: findings} of kept
    files that reach into the test framework: `reach.framework_reach`; any finding grades the
    patch unresolved), appends each script's output to `parts`, and returns the monotonic time
    the apply step ended (the eval step is timed from there).
    """
    if kept:
        env = probe_test_env(rt, command, mounts)
        report_extra["test_env_probed"] = env.probed
        res = rt.run(command("apply.sh"), timeout_s=300, extra_mounts=mounts)
        parts.append(res.stdout)
        if res.ok:
            apply_info.update(applied=True, method=res.stdout.strip().splitlines()[-1].partition("(")[2].rstrip(")"))
            report_extra["test_surface"] = {}
            report_extra["reverted_files"] = restore_test_harness(rt, protected, env, test_patch,
                                                                   report_extra["test_surface"])
            report_extra["tampering"] = find_tampering(rt, protected, env)
        else:
            apply_info.update(applied=False, reason=apply_failure_reason(res.exit_code, res.stdout, log_path))
    applied_at = time.monotonic()
    if apply_info["applied"]:
        res = rt.run(command("eval.sh"), timeout_s=timeout_s, extra_mounts=mounts)
        parts.append(res.stdout)
        if res.timed_out:
            parts.append(f"\n{grading_module().TESTS_TIMEOUT} after {timeout_s:.0f} s\n")
    return applied_at


def probe_test_env(rt: Any, command: Callable[[str], str | list[str]], mounts: list) -> surface.EnvNames:
    """The test environment's importable top-level names (`surface.probe_script`), read in `rt`
    before the patch is applied, by the interpreter the eval script runs (its `source`/`conda
    activate`/`export` lines before the test output marker are run first).  Falls back to this
    interpreter's standard-library names when the probe prints nothing usable."""
    gdir = rt.root / "grading"
    eval_sh = (gdir / "eval.sh").read_text() if (gdir / "eval.sh").is_file() else ""
    setup = []
    for line in eval_sh.splitlines():
        if ">>>>> Start Test Output" in line:
            break
        if line.startswith(("source ", ". ", "conda activate ", "export ")):
            setup.append(line)
    (gdir / "probe_env.py").write_text(surface.probe_script())
    (gdir / "probe.sh").write_text("\n".join([
        *setup, 'here="$(dirname "$0")"',
        'for py in python python3; do if command -v "$py" >/dev/null 2>&1; then exec "$py" -I "$here/probe_env.py"; fi; done',
    ]) + "\n")
    try:
        res = rt.run(command("probe.sh"), timeout_s=120, extra_mounts=mounts)
    except (OSError, RuntimeSetupError) as exc:
        log.warning("test-env probe failed in %s: %s", getattr(rt, "id", rt), exc)
        return surface.EnvNames.fallback()
    return surface.EnvNames.from_output(res.stdout)


def apply_failure_reason(exit_code: int, output: str, log_path: Path, max_lines: int = 8) -> str:
    """One summary line naming the log, then the first distinct error lines of the apply chain
    (whole lines, each at most 300 characters)."""
    errors: list[str] = []
    for line in output.splitlines():
        line = line.strip()
        if (line.startswith(("error:", "patch:", "fatal:")) or "FAILED" in line or "can't find file" in line) \
                and line not in errors:
            errors.append(line if len(line) <= 300 else line[:297] + "...")
    head = (f"patch did not apply with any of the {len(APPLY_CMDS)} methods (git apply, --3way, --reject, "
            f"patch --fuzz=5; exit {exit_code}); full output in {log_path}")
    shown = errors[:max_lines]
    more = [f"... and {len(errors) - max_lines} more error line(s) in the log"] if len(errors) > max_lines else []
    return "\n".join([head, *shown, *more])


def restore_test_harness(rt: Any, protected: set[str], env: surface.EnvNames | None = None,
                          test_patch: str = "", surface_report: dict | None = None) -> dict[str, str]:
    """Put back the base's version of every test-harness file the applied patch changed.

    Reads what really changed from the runtime's hardened `git diff` of the workspace
    against the base (not from the patch text), so no patch format can slip a change
    past the filter.  Judged by name (`patching.harness_change_reason`) and against the trees
    and the test environment `env` (`app.grading.surface`): every pytest configuration file
    whole, `__init__.py` files on the test path, new modules that shadow an importable one,
    the test code the instance's tests import (`testcode`: what pytest collects and only the tests
    use; library code is kept wherever it lives).  Returns {path: reason}; fills `surface_report`
    with the layout, each put-back path's rule and why, and the library modules kept
    (`report["test_surface"]`).  Raises
    `RuntimeSetupError` when the files cannot be put back (infrastructure: the grade is not a score).
    """
    base = Path(rt.describe()["base_repo"])
    env = env or surface.EnvNames.fallback()
    changes = read_patch(rt.patch()).files
    changed = {p for change in changes for p in change.paths}
    trees = surface.Trees.scan(base, rt.base_commit, rt.workspace, protected)
    reasons, report = testcode.put_back(trees, testcode.Layout.read(trees, env, rt.workdir), changed, env,
                                        protected, test_patch)
    if surface_report is not None:
        surface_report.update(report)
    if not reasons:
        return reasons
    in_base = [p for p in reasons
               if git(base, "cat-file", "-e", f"{rt.base_commit}:{p}", check=False).returncode == 0]
    steps = [["rm", "-rf", "--", *reasons]]
    if in_base:
        steps.append(["git", "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false", "checkout",
                      rt.base_commit, "--", *in_base])
    for argv in steps:
        res = rt.run(argv, timeout_s=120)
        if not res.ok:
            raise RuntimeSetupError("grade", f"could not put back test files ({argv[0]} exit {res.exit_code}): "
                                             f"{(res.stderr or res.stdout).strip()[:500]}")
    return dict(sorted(reasons.items()))


def find_tampering(rt: Any, protected: set[str], env: surface.EnvNames | None = None) -> dict[str, list[str]]:
    """{path: findings} for the Python files the applied patch still changes (after
    `restore_test_harness`) that newly reach into the test framework or the interpreter
    (`reach.framework_reach`).  Any entry grades the patch unresolved.

    A new file counts only when something can import it: a changed file or a file of the base
    names it in an import (`surface.imported_new_files`); a new module nothing imports never runs.
    """
    base = Path(rt.describe()["base_repo"])
    env = env or surface.EnvNames.fallback()
    trees = surface.Trees.scan(base, rt.base_commit, rt.workspace, protected)
    own = surface.own_top_names(trees, trees.import_roots(env, rt.workdir))
    kept = [c.new for c in read_patch(rt.patch()).files if c.new and c.new.endswith((".py", ".pyw"))]
    reachable = surface.imported_new_files(trees, kept)
    out: dict[str, list[str]] = {}
    for path in kept:
        if not trees.in_base(path) and path not in reachable:
            continue
        found = reach.framework_reach(trees.text(path, base=True), trees.text(path), own)
        if found:
            out[path] = found
    return out


RuntimeFactory = Callable[..., Any]  # OciRuntime.prepare's signature


def default_runtime_factory() -> RuntimeFactory:
    from app.runtimes.oci import OciRuntime

    return OciRuntime.prepare


def check_tools(rt: Any, record: InstanceRecord) -> None:
    """Raise `VerifierError` naming the tools the image lacks for `record.grader`."""
    from app.runtimes.rootfs import resolve_inside

    lacking = missing_tools(functools.partial(resolve_inside, rt.rootfs), REQUIRED_TOOLS[record.grader])
    if lacking:
        raise VerifierError(f"image {record.image} has no {' and no '.join(lacking)} on its PATH, which the "
                            f"{record.grader} grader runs: instance {record.instance_id} cannot be graded there")
