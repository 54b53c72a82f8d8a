"""SWE-bench grading of an agent patch in a fresh runtime (`grade`), with a grade cache."""
from app.grading.grader import cache_key, grade
from app.grading.outcome import GradeResult, patch_sha256, record_hash
from app.grading.patching import PatchReadError, drop_test_changes, read_patch, harness_change_reason

__all__ = ["GradeResult", "grade", "cache_key", "patch_sha256", "record_hash", "drop_test_changes",
           "read_patch", "harness_change_reason", "PatchReadError"]
