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

import json
import logging
import time
from pathlib import Path
from typing import Any

import redis as redis_lib

from app.config import Settings, get_settings
from app.redis_client import get_redis
from app.grading.image import grade_in_image
from app.grading.outcome import GradeResult, grade_log_path, grade_result, patch_sha256, record_hash
from app.grading.patching import PatchReadError, apply_script, drop_test_changes, files_of_test_ids, read_patch
from app.grading.steps import GRADING_DIR, apply_then_eval
from app.tasksets.swebench_compat import grading_module, make_test_spec
from app.runtimes.local import LocalRuntime
from app.runtimes.paths import RuntimePaths
from app.runtimes.sandbox import Mount
from app.tasksets.schema import InstanceRecord

log = logging.getLogger(__name__)

CACHE_PREFIX = "turnstile:grade:v3"  # v3: test code is what pytest collects and only the tests use (testcode)
CACHE_TTL_S = 30 * 24 * 3600


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
        result = grade_in_image(record, patch, settings=settings, timeout_s=timeout_s)
    else:
        result = _grade_fresh(record, patch, settings, timeout_s, confine)
    if cache is not None:
        try:
            cache.set(key, json.dumps(result.to_dict() | {"cached": False}), ex=CACHE_TTL_S)
        except redis_lib.RedisError as exc:
            log.warning("could not store grade in cache: %s", exc)
    return result


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
        return grade_result(record, spec, patch, log_path, apply_info, {"dropped_test_files": [], "patch_sha256": psha},
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
    return grade_result(record, spec, kept, log_path, apply_info, report_extra, timings)


def _gdir(rt: LocalRuntime, host_dir: Path) -> str:
    return GRADING_DIR if rt.confined else str(host_dir)
