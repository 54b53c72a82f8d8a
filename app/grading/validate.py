"""Check a task set by grading: every instance's gold patch must resolve it, an empty patch must not.

    checks = validate_instances(task_set.instances, jobs=2)
    bad = [c for c in checks if c.problems]

An instance that its own gold patch does not resolve can never give a reward (a wrong
test id, a test that never runs, a broken environment); one that an empty patch resolves
pays for doing nothing.  For a Harbor task the gold patch is what its oracle
(`solution/solve.sh`) changes, run in a fresh runtime of its image (`app.grading.harbor`).
That every test id can be read back by the record's parser is checked at load
(`swebench_compat.unmatchable_test_ids`); ids absent from the gold run's log are listed here.  Both are found only by running the tests, so this grades each
instance twice, fresh (no grade cache), with the grader an episode uses (`grade`).
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from app.config import Settings, get_settings
from app.grading.grader import grade
from app.grading.outcome import GradeResult
from app.runtimes.errors import RuntimeSetupError
from app.tasksets.schema import InstanceRecord


@dataclasses.dataclass
class InstanceCheck:
    """The two grades of one instance (None when grading failed: `error` says why) and the time taken (s)."""

    instance_id: str
    gold: GradeResult | None = None
    empty: GradeResult | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def problems(self) -> list[str]:
        """What is wrong with the instance, one sentence each; [] when it is sound."""
        if self.error:
            return [f"could not be graded: {self.error}"]
        out = []
        assert self.gold is not None and self.empty is not None
        if not self.gold.resolved:
            status = self.gold.report.get("tests_status", {})
            failing = [*status.get("FAIL_TO_PASS", {}).get("failure", []), *status.get("PASS_TO_PASS", {}).get("failure", [])]
            tampering = self.gold.report.get("tampering") or {}
            reason = self.gold.report["apply"].get("reason") or (
                f"reaches into the test framework: {tampering}" if tampering else None) or (
                f"reward {self.gold.reward}" if "reward_file" in self.gold.report
                else f"failing: {', '.join(failing[:5]) or 'no test ran'}")
            put_back = (self.gold.report.get("reverted_files") or {})
            if put_back:
                reason += "; put back: " + ", ".join(f"{p} ({r})" for p, r in put_back.items())
            out.append(f"cannot be solved: the gold patch does not resolve it ({reason}; log {self.gold.log_path})")
        if self.empty.resolved:
            out.append(f"an empty patch resolves it (log {self.empty.log_path})")
        for field, ids in self.gold.report.get("tests_missing", {}).items():
            if ids:
                out.append(f"{len(ids)} {field} id(s) never appear in the gold run's test log: {', '.join(ids[:5])}")
        return out


    @property
    def surface_notes(self) -> list[str]:
        """What the grader put back of the gold patch and why, rule by rule, the library modules it
        kept, and an undecided test layout (`report["test_surface"]`); [] when there is nothing to say."""
        surface = (self.gold.report.get("test_surface") or {}) if self.gold is not None else {}
        out = []
        layout = surface.get("layout") or {}
        if layout and not layout.get("decided"):
            out.append(f"test layout undecided: {layout.get('rule')}")
        for path, entry in (surface.get("reverted") or {}).items():
            out.append(f"gold: put back {path} [{entry.get('rule')}]: {entry.get('why')}")
        for path, why in (surface.get("kept") or {}).items():
            out.append(f"gold: kept {path}: {why}")
        return out


def check_instance(record: InstanceRecord, *, settings: Settings | None = None, timeout_s: float = 1800) -> InstanceCheck:
    """Grade `record`'s gold patch and an empty patch (fresh, uncached)."""
    t0 = time.monotonic()
    check = InstanceCheck(record.instance_id)
    try:
        gold = record.patch
        if record.grader == "harbor":  # the oracle is a script: its changes are the gold patch
            from app.grading.harbor import oracle_patch

            gold = oracle_patch(record, settings=settings or get_settings())
        check.gold = grade(record, gold, settings=settings, use_cache=False, timeout_s=timeout_s)
        check.empty = grade(record, "", settings=settings, use_cache=False, timeout_s=timeout_s)
    except RuntimeSetupError as exc:
        check.error = str(exc)
    check.seconds = time.monotonic() - t0
    return check


def validate_instances(
    records: Sequence[InstanceRecord],
    *,
    jobs: int = 2,
    settings: Settings | None = None,
    timeout_s: float = 1800,
    on_result: Callable[[InstanceCheck], None] | None = None,
) -> list[InstanceCheck]:
    """`check_instance` for every record, `jobs` at a time; results in the records' order.

    `on_result` is called with each check as it finishes (for progress output).
    Raises ValueError when `jobs` < 1.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, not {jobs}")

    def run(record: InstanceRecord) -> InstanceCheck:
        check = check_instance(record, settings=settings, timeout_s=timeout_s)
        if on_result is not None:
            on_result(check)
        return check

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(run, records))
