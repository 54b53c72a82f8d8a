"""Grade a patch inside the task's own container image, in a fresh runtime of that image.

    result = grade_in_image(record, patch)      # GradeResult, as `grader.grade` returns

Same steps and defences as `grader._grade_fresh` (read the patch with unidiff, drop its
test-harness changes, apply at the strip level it was read with, put back every harness file
the applied tree still changes, swebench's report), with the runtime an `OciRuntime` of
`record.image` and the repository at `record.repo_dir`.  Per grader:

* `swebench`: swebench's apply chain, then the record's eval script (swebench's own, built
  for the row's repo and version) in the image's `testbed` env; swebench's report decides.
* `rebench`: SWE-rebench V2's `git apply -v --3way --recount --ignore-space-change
  --whitespace=nowarn` after `git reset --hard HEAD`; its eval script applies `test_patch` the
  same way and runs `install_config.test_cmd`; resolved when the PASSED tests are exactly
  FAIL_TO_PASS ∪ PASS_TO_PASS, read by the parser the row names.
* `r2egym`: swebench's apply chain, then the image's runner `<repo_dir>/run_tests.sh` with
  `r2e_tests` linked to the image's `/r2e_tests` (as R2E-Gym's `setup_env` links them); the
  record's `hidden_paths` the patch touches are dropped from it and put back (the agent never
  saw them, and must not plant its own); resolved when every parsed status equals
  `expected_statuses` (`verifier.r2e_match`).
* `harbor`: see `app.grading.harbor`.

Every grade runs with no network.  An image without the tools the grader runs
(`verifier.REQUIRED_TOOLS`) raises `VerifierError` (masked, never reward 0).

swebench's eval scripts reinstall the package before the tests (`python -m pip install -e .`,
`python setup.py develop`, `python -m pip install .`: the spec's `install` line), which needs
the network (build isolation fetches setuptools) and a writable env, and a grade has neither
(the image is read-only).  `offline_eval_script` handles that step: where the image's
`testbed` env already has the repository installed in develop mode (an `.egg-link`, `.pth` or
`__editable__` file naming it, as SWE-bench images are built), the step is dropped, since the
tests import the patched copy itself; otherwise it is run offline (`--no-index --no-deps
--no-build-isolation`) into a scratch `--target` put first on PYTHONPATH.  What was done is in
the report (`eval_install`).  A patch to compiled code (C, Cython) is then not rebuilt where
the image installed in develop mode: swebench's own reinstall would have rebuilt it.
"""
from __future__ import annotations

import os
import re
import shlex
import time
from pathlib import Path, PurePosixPath
from typing import Any

from app.config import Settings
from app.grading.harbor import grade_harbor
from app.grading.outcome import GradeResult, grade_log_path, grade_result, patch_sha256, warn_missing
from app.grading.patching import APPLIED_MARKER, PatchReadError, apply_script, drop_test_changes, files_of_test_ids, read_patch
from app.grading.steps import GRADING_DIR, RuntimeFactory, apply_then_eval, check_tools, default_runtime_factory
from app.grading.verifier import r2e_match, r2e_test_id, rebench_match
from app.runtimes.oci_sandbox import TESTBED_ENV
from app.runtimes.paths import RuntimePaths
from app.runtimes.sandbox import Mount
from app.tasksets.formats.r2egym import RUNNER
from app.tasksets.formats.rebench import APPLY_FLAGS
from app.tasksets.schema import InstanceRecord
from app.tasksets.swebench_compat import grading_module, make_test_spec

def rebench_apply_script(patch_file: str, strip: int = 1) -> str:
    """SWE-rebench V2's apply step (`scripts/eval.py::run_in_container`), printing the markers
    `apply_script` prints (`>>>>> Applied Patch (...)` / swebench's `>>>>> Patch Apply Failed`)."""
    q = shlex.quote(patch_file)
    cmd = f"git apply {APPLY_FLAGS} -p{int(strip)}"
    return "\n".join([
        "set -u", "git reset --hard HEAD >/dev/null",
        f'if {cmd} {q}; then echo "{APPLIED_MARKER} (git apply --3way --recount)"; exit 0; fi',
        'echo ">>>>> Patch Apply Failed"; exit 1',
    ]) + "\n"


def grade_in_image(record: InstanceRecord, patch: str, *, settings: Settings, timeout_s: float = 1800,
                   runtime_factory: RuntimeFactory | None = None) -> GradeResult:
    """Grade `patch` on an image-served `record` (see the module docstring).

    Raises `VerifierError` (the image cannot run the grader), `RuntimeSetupError` (the image
    cannot be pulled or unpacked, or its repository folder is missing: infrastructure, not a score).
    """
    if record.grader == "harbor":
        return grade_harbor(record, patch, settings=settings, runtime_factory=runtime_factory)
    t0 = time.monotonic()
    prepare = runtime_factory or default_runtime_factory()
    spec = make_test_spec(record)
    psha = patch_sha256(patch)
    paths = RuntimePaths.from_settings(settings)
    log_path = grade_log_path(paths, record, patch)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    test_ids = record.FAIL_TO_PASS + record.PASS_TO_PASS + list(record.expected_statuses)
    hidden = hidden_in_repo(record)
    protected = set(record.test_files) | files_of_test_ids(test_ids) | set(hidden)
    try:
        strip = read_patch(patch).strip
        kept, dropped = drop_test_changes(patch, [*record.test_files, *hidden], record.test_patch, test_ids)
        if record.test_patch.strip():
            protected |= {p for f in read_patch(record.test_patch).files for p in f.paths}
    except PatchReadError as exc:
        log_path.write_text(f"{exc}\n{grading_module().APPLY_PATCH_FAIL}\n", encoding="utf-8")
        apply_info = {"applied": False, "method": None, "reason": f"patch refused: {exc}; log: {log_path}"}
        return grade_result(record, spec, patch, log_path, apply_info, {"dropped_test_files": [], "patch_sha256": psha},
                            {"total_s": round(time.monotonic() - t0, 3)})
    extra: dict[str, Any] = {"dropped_test_files": dropped, "reverted_files": {}, "patch_sha256": psha,
                             "image": record.image, "grader": record.grader}
    apply_info = {"applied": not kept, "method": None if kept else "empty patch", "reason": None}
    parts: list[str] = []
    with prepare(record, settings=settings, paths=paths, purpose="grade") as rt:
        check_tools(rt, record)
        t1 = time.monotonic()
        gdir = rt.root / "grading"
        gdir.mkdir()
        (gdir / "patch.diff").write_text(kept, encoding="utf-8", errors="surrogateescape")
        applier = rebench_apply_script if record.grader == "rebench" else apply_script
        (gdir / "apply.sh").write_text(applier(f"{GRADING_DIR}/patch.diff", strip))
        script = spec.eval_script
        if record.grader == "swebench":
            script, extra["eval_install"] = offline_eval_script(script, rt.rootfs, record.repo_dir)
        (gdir / "eval.sh").write_text(script if record.grader != "r2egym" else r2e_eval_script(record))
        mounts = [Mount(gdir, GRADING_DIR, False)]
        t2 = apply_then_eval(rt, lambda script: f"bash {GRADING_DIR}/{script} 2>&1", mounts, kept, protected,
                             log_path, timeout_s, apply_info, extra, parts, record.test_patch)
        t3 = time.monotonic()
        extra.update(confined=True, runtime_timings=rt.timings, image_digest=getattr(rt, "digest", None))
    log_path.write_text("".join(parts), encoding="utf-8", errors="replace")
    timings = {"prepare_s": round(t1 - t0, 3), "apply_s": round(t2 - t1, 3), "eval_s": round(t3 - t2, 3),
               "total_s": round(time.monotonic() - t0, 3)}
    # SWE-rebench V2 and R2E-Gym judge the log by their own rule: theirs is the verdict, and what
    # is missing is read as their rule reads ids (swebench's reading would warn of ids that are there).
    own_rule = record.grader in ("rebench", "r2egym")
    result = grade_result(record, spec, kept, log_path, apply_info, extra, timings, final=not own_rule)
    if own_rule:
        _rejudge(record, spec, log_path, result)
        warn_missing(record, result)
    return result


_INSTALL = re.compile(r"^\s*(?:python\d*(?:\.\d+)?\s+-m\s+)?pip\s+install\s|^\s*python\d*(?:\.\d+)?\s+setup\.py\s+(develop|install)\b")
REINSTALL_TARGET = "/tmp/turnstile-reinstall"


def develop_install(rootfs: Path, repo_dir: str) -> str | None:
    """The file of the image's `testbed` env that installs `repo_dir` in develop mode (an
    `.egg-link`, or a `.pth` naming the folder), or None."""
    from app.runtimes.rootfs import resolve_inside

    lib = resolve_inside(rootfs, f"{TESTBED_ENV}/lib")
    if lib is None or not lib.is_dir():
        return None
    # Each site-packages is resolved inside the image too: a `pythonX.Y` link pointing out of the
    # rootfs would otherwise be followed by the host's glob (and its files read on the host).
    inside = "/" + str(lib.relative_to(rootfs))
    sites = (resolve_inside(rootfs, f"{inside}/{name}/site-packages") for name in sorted(os.listdir(lib))
             if name.startswith("python"))
    for site in (s for s in sites if s is not None and s.is_dir()):
        for f in [*sorted(site.glob("*.egg-link")), *sorted(site.glob("*.pth"))]:
            if f.is_symlink() or not f.is_file() or f.stat().st_size > 1 << 20:
                continue
            if any(line.strip().rstrip("/") == repo_dir.rstrip("/")
                   for line in f.read_text(encoding="utf-8", errors="replace").splitlines()):
                return str(f.relative_to(rootfs))
        for f in sorted(site.glob("__editable__*")):
            if f.is_file() and not f.is_symlink() and repo_dir in f.read_text(encoding="utf-8", errors="replace"):
                return str(f.relative_to(rootfs))
    return None


def offline_eval_script(script: str, rootfs: Path, repo_dir: str) -> tuple[str, list[dict[str, str]]]:
    """(`script` with its reinstall lines made offline, what was done per line) (module docstring).
    Only lines before swebench's `>>>>> Start Test Output` marker are touched."""
    out, done, before_tests = [], [], True
    develop = None
    for line in script.split("\n"):
        if ">>>>> Start Test Output" in line:
            before_tests = False
        if before_tests and _INSTALL.match(line):
            develop = develop or develop_install(rootfs, repo_dir)
            if develop:
                done.append({"command": line.strip(), "action": f"dropped: the image installs {repo_dir} in "
                                                                 f"develop mode (/{develop})"})
                out.append(": " + shlex.quote(f"turnstile: dropped {line.strip()} (develop install in the image)"))
                continue
            cmd = (f"python -m pip install --no-index --no-deps --no-build-isolation --upgrade "
                   f"--target {REINSTALL_TARGET} . && export PYTHONPATH={REINSTALL_TARGET}${{PYTHONPATH:+:$PYTHONPATH}}")
            done.append({"command": line.strip(), "action": f"offline into {REINSTALL_TARGET}: {cmd}"})
            out.append(cmd)
            continue
        out.append(line)
    return "\n".join(out), done


def hidden_in_repo(record: InstanceRecord) -> list[str]:
    """The record's `hidden_paths` inside its repository, relative to it (the patch may not touch them)."""
    root = PurePosixPath(record.repo_dir)
    paths = [PurePosixPath(str(p)) for p in (record.model_extra or {}).get("hidden_paths") or []]
    return [str(p.relative_to(root)) for p in paths if root in p.parents]


def r2e_eval_script(record: InstanceRecord) -> str:
    """The image's runner `run_tests.sh` in the repository (R2E-Gym's, for its hidden tests), with
    `r2e_tests` linked to `/r2e_tests` as R2E-Gym's `setup_env` links it, between swebench's markers."""
    return "\n".join(["#!/bin/bash", "set -uxo pipefail", f"cd {shlex.quote(record.repo_dir)}",
                      "if [ -d /r2e_tests ]; then rm -rf r2e_tests && ln -s /r2e_tests r2e_tests; fi",
                      ": '>>>>> Start Test Output'", f"bash {RUNNER}", "SWEBENCH_TEST_EXIT_CODE=$?",
                      ": '>>>>> End Test Output'", 'echo ">>>>> Test Exit Code: $SWEBENCH_TEST_EXIT_CODE"']) + "\n"


def _rejudge(record: InstanceRecord, spec: Any, log_path: Path, result: GradeResult) -> None:
    """Replace swebench's resolved rule by the format's own (SWE-rebench V2, R2E-Gym), from the same log."""
    status, ran = grading_module().get_logs_eval(spec, str(log_path))
    if record.grader == "rebench":
        ok = bool(ran) and rebench_match(status, record.FAIL_TO_PASS, record.PASS_TO_PASS)
        result.report["rebench_passed_match"] = ok
    else:
        ok, diff = r2e_match(status, record.expected_statuses) if ran else (False, {})
        result.report["r2e_match"] = diff
        # Ids in R2E-Gym's form (`Class.test`): "missing" is read the same way as the statuses are.
        missing = set(diff.get("missing", [])) if ran else set(map(r2e_test_id, record.expected_statuses))
        result.report["tests_missing"] = {
            "FAIL_TO_PASS": [t for t in record.FAIL_TO_PASS if r2e_test_id(t) in missing], "PASS_TO_PASS": []}
        ok = bool(ran) and ok
    result.resolved = ok and bool(result.report["apply"]["applied"]) and not result.report.get("tampering")
    result.report["resolved"] = result.resolved
    result.reward = 1.0 if result.resolved else 0.0
