"""Grade a patch on a task instance, SWE-bench style, in a fresh runtime; cache by (instance, patch hash).

    result = grade(instance_record, patch)   # GradeResult(resolved, reward, report, log_path, cached)

Steps (as swebench 5.0.2's `run_instance`, without docker):
  1. Read the patch's paths with unidiff and drop its changes to the test harness: the
     instance's test files, test modules, pytest configuration, interpreter start-up hooks,
     package metadata, bytecode (`patching.drop_test_changes`; the rule is stated there).
     A patch whose paths cannot be read is refused: reward 0, `report["apply"]["reason"]`.
  2. Prepare a *fresh* runtime of the instance (same code path as an episode: cached
     base + venv, new workspace), sandboxed without network when bubblewrap exists.
  3. Apply the patch with swebench's chain (`git apply --verbose`, `--3way`, `--reject`,
     `patch --fuzz=5`), at the strip level its paths were read with.  If nothing applies:
     reward 0, `report["apply"]["reason"]` (a one-line summary, the log path, git's errors).
  4. Diff the applied tree against the base (the runtime's hardened `git diff`) and put
     back the base's version of every test-harness file still changed: by name as in step 1,
     every pytest configuration file whole (`setup.cfg` and `pyproject.toml` included), and by
     pytest's import rules against the trees and the test environment (probed before the
     patch is applied): `__init__.py` files on the test path, new modules that shadow an
     importable one (`app.grading.surface`), the test code the instance's tests import (`app.grading.testcode`).
     The tests run under the base commit's test harness whatever form the patch took
     (`report["reverted_files"]`).  A kept Python file that newly reaches into the test
     framework (`_pytest`, pytest hooks, unittest internals, `sys.modules` or builtins
     writes: `reach.framework_reach`) grades unresolved, the findings in `report["tampering"]`:
     the tests run in the process the code under test runs in, so no report it prints can be
     trusted once that code reaches into it.
  5. Run the record's `eval_script` (exit-code lines inserted as v5's `make_test_spec`
     does) with stdout and stderr merged into one log.  It restores the test files from
     the base, applies `test_patch`, and runs `test_cmd` between the markers.
  6. swebench's `get_eval_report` (→ `get_logs_eval` → the record's `log_parser`, then
     `get_eval_tests_report`) gives the FAIL_TO_PASS / PASS_TO_PASS results and
     `resolved`; reward = 1.0 if resolved else 0.0 (binary reward as in SWE-Gym /
     SWE-RL / DeepSWE).  Ids that never appear in the log are listed apart in
     `report["tests_missing"]` and logged as a warning: swebench counts them as failed.

Every grade writes its own log, `<grading_logs>/<instance id>/<record hash>-<patch hash>-<nonce>.log`,
so grades of different records with one id, or concurrent grades of one patch, never share a file.

The cache is Redis (`REDIS_URL`), key `turnstile:grade:v2:<instance_id>:<record hash>:<patch sha256>`;
the record hash covers every field that changes the outcome, so an edited record never hits
a stale entry.  Without a reachable Redis, grading still works, uncached.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import redis as redis_lib

from app.config import Settings, get_settings
from app.redis_client import get_redis
from app.grading import reach, surface, testcode
from app.grading.patching import (
    APPLY_CMDS,
    PatchReadError,
    apply_script,
    drop_test_changes,
    read_patch,
    files_of_test_ids,
)
from app.runtimes.errors import RuntimeSetupError
from app.gitutil import git
from app.tasksets.swebench_compat import grading_module, make_test_spec
from app.runtimes.local import LocalRuntime
from app.runtimes.paths import RuntimePaths
from app.runtimes.sandbox import Mount
from app.tasksets.schema import InstanceRecord

log = logging.getLogger(__name__)

CACHE_PREFIX = "turnstile:grade:v3"  # v3: test code is what pytest collects and only the tests use (testcode)
CACHE_TTL_S = 30 * 24 * 3600
GRADING_DIR = "/run/turnstile/grading"
_OUTCOME_FIELDS = ("instance_id", "patch", "test_patch", "eval_script", "test_cmd", "test_files", "FAIL_TO_PASS",
                   "PASS_TO_PASS", "log_parser", "eval_type", "source", "bug_patch", "install", "python", "base_commit",
                   "image", "repo_dir", "grader", "expected_statuses", "harbor")


@dataclasses.dataclass
class GradeResult:
    """Outcome of one grade.

    resolved: every FAIL_TO_PASS and PASS_TO_PASS test passed (swebench RESOLVED_FULL).
    reward: 1.0 if resolved else 0.0.
    report: swebench's per-instance report (`patch_successfully_applied`, `resolved`,
      `tests_status` {FAIL_TO_PASS, PASS_TO_PASS, FAIL_TO_FAIL, PASS_TO_FAIL → {success, failure}})
      plus `apply` {applied, method, reason}, `dropped_test_files` (dropped from the patch),
      `reverted_files` {path: reason} (put back to the base after applying), `test_surface`
      {layout: {decided, rule, collected_test_files, test_dirs, library_roots}, reverted: {path:
      {rule, why}}, kept: {path: why it is library code}}, `tests_missing`
      {FAIL_TO_PASS, PASS_TO_PASS → ids absent from the test log}, `patch_sha256`,
      `confined`, `timings` (seconds).
    log_path: the grading log (apply output + eval script output), or None.
    cached: True when served from the grade cache.
    """

    resolved: bool
    reward: float
    report: dict[str, Any]
    log_path: str | None
    cached: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def record_hash(record: InstanceRecord) -> str:
    data = record.model_dump(mode="json")
    fields = {k: data.get(k) for k in _OUTCOME_FIELDS}
    if record.harbor is not None:  # a Harbor task's tests live in its folder, not in the record
        fields["harbor_tests"] = _tree_digest(Path(record.harbor.tests_dir))
    blob = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _tree_digest(root: Path) -> str:
    """SHA-256 over the relative paths and bytes of the files under `root` (links by their target)."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")) if root.is_dir() else []:
        h.update(str(p.relative_to(root)).encode())
        h.update(os.readlink(p).encode() if p.is_symlink() else p.read_bytes() if p.is_file() else b"/")
    return h.hexdigest()[:16]


def patch_sha256(patch: str | None) -> str:
    return hashlib.sha256((patch or "").encode("utf-8", errors="surrogateescape")).hexdigest()


def cache_key(record: InstanceRecord, patch: str | None) -> str:
    return f"{CACHE_PREFIX}:{record.instance_id}:{record_hash(record)}:{patch_sha256(patch)}"


def _redis(settings: Settings, client: Any) -> Any:
    if client is not None:
        return client
    try:
        # The process's shared client, unless the caller grades against other settings.
        c = get_redis() if settings.redis_url == get_settings().redis_url else \
            redis_lib.Redis.from_url(settings.redis_url, socket_connect_timeout=2, socket_timeout=5)
        c.ping()
        return c
    except redis_lib.RedisError as exc:
        log.warning("grade cache disabled: Redis at %s unreachable (%s)", settings.redis_url, exc)
        return None


def grade(
    instance_record: dict | InstanceRecord,
    patch: str | None,
    *,
    settings: Settings | None = None,
    redis_client: Any = None,
    use_cache: bool = True,
    timeout_s: float = 1800,
    confine: bool | None = None,
) -> GradeResult:
    """Grade `patch` (unified diff text; "" or None = no change) on `instance_record`.

    A patch that does not apply gives resolved=False, reward 0.0 and
    `report["apply"]["reason"]`.  Raises `pydantic.ValidationError` for an invalid
    record and `app.runtimes.RuntimeSetupError` when the runtime cannot be built
    (infrastructure failure: not a score, so the caller may retry).  A record served by
    its container image (`source.kind == "image"`) is graded there (`app.grading.image`);
    one whose image cannot run the grader raises `app.grading.verifier.VerifierError`
    (a `RuntimeSetupError`: the episode fails and is masked, never scored 0).
    """
    record = instance_record if isinstance(instance_record, InstanceRecord) else InstanceRecord.model_validate(instance_record)
    settings = settings or get_settings()
    patch = patch or ""
    key = cache_key(record, patch)
    cache = _redis(settings, redis_client) if use_cache else None
    if cache is not None:
        try:
            hit = cache.get(key)
        except redis_lib.RedisError:
            hit = None
        if hit:
            data = json.loads(hit)
            return GradeResult(data["resolved"], data["reward"], data["report"], data["log_path"], cached=True)

    if record.source_kind == "image":  # the task's own container image (app.grading.image)
        from app.grading.image import grade_in_image

        result = grade_in_image(record, patch, settings=settings, timeout_s=timeout_s)
    else:
        result = _grade_fresh(record, patch, settings, timeout_s, confine)
    if cache is not None:
        try:
            cache.set(key, json.dumps(result.to_dict() | {"cached": False}), ex=CACHE_TTL_S)
        except redis_lib.RedisError as exc:
            log.warning("could not store grade in cache: %s", exc)
    return result


def grade_log_path(paths: RuntimePaths, record: InstanceRecord, patch: str) -> Path:
    """A new log file path for one grade of `patch` on `record` (never shared with another grade).

    The instance id becomes a folder name with every character outside `[A-Za-z0-9._-]`
    replaced, so an id cannot name a path outside `paths.grading_logs`.
    """
    folder = re.sub(r"[^A-Za-z0-9._-]", "_", record.instance_id).lstrip(".") or "_"
    name = f"{record_hash(record)}-{patch_sha256(patch)[:16]}-{uuid.uuid4().hex[:8]}.log"
    return paths.grading_logs / folder / name


def _grade_fresh(record: InstanceRecord, patch: str, settings: Settings, timeout_s: float, confine: bool | None) -> GradeResult:
    t0 = time.monotonic()
    spec = make_test_spec(record)
    psha = patch_sha256(patch)
    paths = RuntimePaths.from_settings(settings)
    log_path = grade_log_path(paths, record, patch)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    protected = set(record.test_files) | files_of_test_ids(record.FAIL_TO_PASS + record.PASS_TO_PASS)
    try:
        strip = read_patch(patch).strip
        kept, dropped = drop_test_changes(patch, record.test_files, record.test_patch,
                                          record.FAIL_TO_PASS + record.PASS_TO_PASS)
        if record.test_patch.strip():
            protected |= {p for f in read_patch(record.test_patch).files for p in f.paths}
    except PatchReadError as exc:
        log_path.write_text(f"{exc}\n{grading_module().APPLY_PATCH_FAIL}\n", encoding="utf-8")
        apply_info = {"applied": False, "method": None, "reason": f"patch refused: {exc}; log: {log_path}"}
        return _result(record, spec, patch, log_path, apply_info, {"dropped_test_files": [], "patch_sha256": psha},
                       {"total_s": round(time.monotonic() - t0, 3)})
    report_extra: dict[str, Any] = {"dropped_test_files": dropped, "reverted_files": {}, "patch_sha256": psha}
    apply_info = {"applied": not kept, "method": None if kept else "empty patch", "reason": None}

    with LocalRuntime.prepare(record, settings=settings, paths=paths, confine=confine, purpose="grade") as rt:
        t1 = time.monotonic()
        gdir = rt.root / "grading"
        gdir.mkdir()
        (gdir / "patch.diff").write_text(kept, encoding="utf-8", errors="surrogateescape")
        (gdir / "apply.sh").write_text(apply_script(f"{_gdir(rt, gdir)}/patch.diff", strip))
        (gdir / "eval.sh").write_text(spec.eval_script)
        mounts = [Mount(gdir, GRADING_DIR, False)] if rt.confined else []
        parts: list[str] = []
        where = _gdir(rt, gdir)
        t2 = apply_then_eval(rt, lambda script: ["/bin/bash", "-c", f"bash {where}/{script} 2>&1"], mounts, kept,
                             protected, log_path, timeout_s, apply_info, report_extra, parts, record.test_patch)
        t3 = time.monotonic()
        report_extra["confined"] = rt.confined
        report_extra["runtime_timings"] = rt.timings
    log_path.write_text("".join(parts), encoding="utf-8", errors="replace")
    timings = {"prepare_s": round(t1 - t0, 3), "apply_s": round(t2 - t1, 3), "eval_s": round(t3 - t2, 3),
               "total_s": round(time.monotonic() - t0, 3)}
    return _result(record, spec, kept, log_path, apply_info, report_extra, timings)



def apply_then_eval(rt: Any, command: Callable[[str], str | list[str]], mounts: list, kept: str, protected: set[str],
                    log_path: Path, timeout_s: float, apply_info: dict, report_extra: dict, parts: list[str],
                    test_patch: str = "") -> float:
    """Run `apply.sh` (when a patch is kept) then `eval.sh` in `rt`, as swebench's `run_instance` does.

    `command(script)` is the argv (or shell line) that runs a script of the grading folder in `rt`.
    Before the patch is applied, the test environment's importable names are probed
    (`probe_test_env`).  Updates `apply_info` (applied, method or reason),
    `report_extra["reverted_files"]` (test-harness files the patch touched, restored after it
    applied: `_restore_test_harness`) and `report_extra["tampering"]` ({path: findings} of kept
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
            report_extra["reverted_files"] = _restore_test_harness(rt, protected, env, test_patch,
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


def _result(record: InstanceRecord, spec: Any, kept: str, log_path: Path, apply_info: dict, report_extra: dict,
            timings: dict) -> GradeResult:
    g = grading_module()
    prediction = {"instance_id": record.instance_id, "model_name_or_path": "turnstile", "model_patch": kept}
    report = g.get_eval_report(spec, prediction, str(log_path), include_tests_status=True)[record.instance_id]
    resolved = bool(report.get("resolved")) and bool(apply_info["applied"])
    report.update(report_extra)
    report["apply"] = apply_info
    report["tests_missing"] = missing_tests(record, spec, log_path)
    report["timings"] = timings
    missing_f2p = report["tests_missing"]["FAIL_TO_PASS"]
    if report.get("tampering"):  # the code under test reached into the test framework: never a pass
        resolved = False
        report["resolved"] = False
    if missing_f2p:
        log.warning("grade of %s: %d FAIL_TO_PASS test id(s) never appear in the test log %s (counted as failed; "
                    "the instance may be unsolvable): %s", record.instance_id, len(missing_f2p), log_path,
                    ", ".join(missing_f2p[:5]))
    return GradeResult(resolved=resolved, reward=1.0 if resolved else 0.0, report=report, log_path=str(log_path))


def missing_tests(record: InstanceRecord, spec: Any, log_path: Path) -> dict[str, list[str]]:
    """{FAIL_TO_PASS, PASS_TO_PASS → ids the record's log parser did not find in the log}.

    Empty lists when the tests did not run at all (patch not applied, no test output):
    then nothing can be told about single ids.  Matching is swebench's own (`_resolve_case`
    in swebench 5.0.2 `harness/grading.py`, which also accepts its truncated ids).
    """
    g = grading_module()
    out: dict[str, list[str]] = {"FAIL_TO_PASS": [], "PASS_TO_PASS": []}
    status, ran = g.get_logs_eval(spec, str(log_path))
    if not ran or not status:
        return out
    resolve = getattr(g, "_resolve_case", lambda case, sm: case if case in sm else None)
    out["FAIL_TO_PASS"] = [t for t in record.FAIL_TO_PASS if resolve(t, status) is None]
    out["PASS_TO_PASS"] = [t for t in record.PASS_TO_PASS if resolve(t, status) is None]
    return out


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


def _restore_test_harness(rt: Any, protected: set[str], env: surface.EnvNames | None = None,
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
    `_restore_test_harness`) that newly reach into the test framework or the interpreter
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


def _gdir(rt: LocalRuntime, host_dir: Path) -> str:
    return GRADING_DIR if rt.confined else str(host_dir)
