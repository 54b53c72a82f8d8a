"""Grade a patch on a task instance, SWE-bench style, in a fresh runtime; cache by (instance, patch hash).

    result = grade(instance_record, patch)   # GradeResult(resolved, reward, report, log_path, cached)

Steps (../shared/tasks/README.md section 4; swebench 5.0.2 `run_instance`):
  1. Drop the patch's changes to test files and conftest.py (`patching.drop_test_changes`).
  2. Prepare a *fresh* runtime of the instance (same code path as an episode: cached
     base + venv, new workspace), sandboxed without network when bubblewrap exists.
  3. Apply the patch with swebench's chain (`git apply --verbose`, `--3way`, `--reject`,
     `patch --fuzz=5 -p1`).  If nothing applies: reward 0, `report["apply"]["reason"]`.
  4. Run the record's `eval_script` (exit-code lines inserted as v5's `make_test_spec`
     does) with stdout and stderr merged into one log.  It restores the test files from
     the base, applies `test_patch`, and runs `test_cmd` between the markers.
  5. swebench's `get_eval_report` (→ `get_logs_eval` → the record's `log_parser`, then
     `get_eval_tests_report`) gives the FAIL_TO_PASS / PASS_TO_PASS results and
     `resolved`; reward = 1.0 if resolved else 0.0 (binary reward as in SWE-Gym /
     SWE-RL / DeepSWE).

The cache is Redis (`REDIS_URL`), key `turnstile:grade:v1:<instance_id>:<record hash>:<patch sha256>`;
the record hash covers every field that changes the outcome, so an edited record never hits
a stale entry.  Without a reachable Redis, grading still works, uncached.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import redis as redis_lib

from app.config import Settings, get_settings
from app.redis_client import get_redis
from app.grading.patching import apply_script, drop_test_changes
from app.tasksets.swebench_compat import grading_module, make_test_spec
from app.runtimes.local import LocalRuntime
from app.runtimes.paths import RuntimePaths
from app.runtimes.sandbox import Mount
from app.tasksets.schema import InstanceRecord

log = logging.getLogger(__name__)

CACHE_PREFIX = "turnstile:grade:v1"
CACHE_TTL_S = 30 * 24 * 3600
GRADING_DIR = "/run/turnstile/grading"
_OUTCOME_FIELDS = ("instance_id", "patch", "test_patch", "eval_script", "test_cmd", "test_files", "FAIL_TO_PASS",
                   "PASS_TO_PASS", "log_parser", "eval_type", "source", "bug_patch", "install", "python", "base_commit")


@dataclasses.dataclass
class GradeResult:
    """Outcome of one grade.

    resolved: every FAIL_TO_PASS and PASS_TO_PASS test passed (swebench RESOLVED_FULL).
    reward: 1.0 if resolved else 0.0.
    report: swebench's per-instance report (`patch_successfully_applied`, `resolved`,
      `tests_status` {FAIL_TO_PASS, PASS_TO_PASS, FAIL_TO_FAIL, PASS_TO_FAIL → {success, failure}})
      plus `apply` {applied, method, reason}, `dropped_test_files`, `patch_sha256`,
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
    blob = json.dumps({k: data.get(k) for k in _OUTCOME_FIELDS}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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
    (infrastructure failure: not a score, so the caller may retry).
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

    result = _grade_fresh(record, patch, settings, timeout_s, confine)
    if cache is not None:
        try:
            cache.set(key, json.dumps(result.to_dict() | {"cached": False}), ex=CACHE_TTL_S)
        except redis_lib.RedisError as exc:
            log.warning("could not store grade in cache: %s", exc)
    return result


def _grade_fresh(record: InstanceRecord, patch: str, settings: Settings, timeout_s: float, confine: bool | None) -> GradeResult:
    t0 = time.monotonic()
    kept, dropped = drop_test_changes(patch, record.test_files, record.test_patch)
    spec = make_test_spec(record)
    psha = patch_sha256(patch)
    paths = RuntimePaths.from_settings(settings)
    log_path = paths.grading_logs / record.instance_id / f"{psha[:16]}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    report_extra: dict[str, Any] = {"dropped_test_files": dropped, "patch_sha256": psha}
    apply_info = {"applied": not kept.strip(), "method": None if kept.strip() else "empty patch", "reason": None}

    with LocalRuntime.prepare(record, settings=settings, paths=paths, confine=confine, purpose="grade") as rt:
        t1 = time.monotonic()
        gdir = rt.root / "grading"
        gdir.mkdir()
        (gdir / "patch.diff").write_text(kept, encoding="utf-8", errors="surrogateescape")
        (gdir / "apply.sh").write_text(apply_script(f"{_gdir(rt, gdir)}/patch.diff"))
        (gdir / "eval.sh").write_text(spec.eval_script)
        mounts = [Mount(gdir, GRADING_DIR, False)] if rt.confined else []
        parts: list[str] = []
        if kept.strip():
            res = rt.run(["/bin/bash", "-c", f"bash {_gdir(rt, gdir)}/apply.sh 2>&1"], timeout_s=300, extra_mounts=mounts)
            parts.append(res.stdout)
            if res.ok:
                apply_info.update(applied=True, method=res.stdout.strip().splitlines()[-1].partition("(")[2].rstrip(")"))
            else:
                apply_info.update(applied=False, reason=f"patch did not apply (exit {res.exit_code}): {res.stdout.strip()[-1500:]}")
        t2 = time.monotonic()
        if apply_info["applied"]:
            res = rt.run(["/bin/bash", "-c", f"bash {_gdir(rt, gdir)}/eval.sh 2>&1"], timeout_s=timeout_s, extra_mounts=mounts)
            parts.append(res.stdout)
            if res.timed_out:
                parts.append(f"\n{grading_module().TESTS_TIMEOUT} after {timeout_s:.0f} s\n")
        t3 = time.monotonic()
        report_extra["confined"] = rt.confined
        report_extra["runtime_timings"] = rt.timings
    log_path.write_text("".join(parts), encoding="utf-8", errors="replace")

    prediction = {"instance_id": record.instance_id, "model_name_or_path": "turnstile", "model_patch": kept}
    report = grading_module().get_eval_report(spec, prediction, str(log_path), include_tests_status=True)[record.instance_id]
    resolved = bool(report.get("resolved")) and bool(apply_info["applied"])
    report.update(report_extra)
    report["apply"] = apply_info
    report["timings"] = {"prepare_s": round(t1 - t0, 3), "apply_s": round(t2 - t1, 3), "eval_s": round(t3 - t2, 3),
                         "total_s": round(time.monotonic() - t0, 3)}
    return GradeResult(resolved=resolved, reward=1.0 if resolved else 0.0, report=report, log_path=str(log_path))


def _gdir(rt: LocalRuntime, host_dir: Path) -> str:
    return GRADING_DIR if rt.confined else str(host_dir)
